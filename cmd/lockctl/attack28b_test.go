//go:build unix

package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// lockctl run with several names (a MultiLock) never lets its command run
// past the hold, whatever happens to lockctl: killed (-9) or stopped while
// holding A and B, its guard kills the command's group by the session's
// deadline; a second lockctl waiting for B alone, which takes B once the
// lease expires, never sees an "A" after its first "B". The keys on both
// names are gone at the end.
func TestAttack28bGuardBoundsSeveralNamesCommandByHold(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out a TTL: skipped in -short")
	}
	t.Parallel()
	for _, tc := range []struct {
		what    string
		sig     syscall.Signal
		termLog bool
	}{
		{"killed", syscall.SIGKILL, true},
		{"stopped", syscall.SIGSTOP, false},
	} {
		t.Run(tc.what, func(t *testing.T) {
			t.Parallel()
			base, dir := uniqueName(t), t.TempDir()
			a, b := base+"/a", base+"/b"
			log := filepath.Join(dir, "log")
			pidfile, gpidfile := filepath.Join(dir, "pid"), filepath.Join(dir, "gpid")
			first := start(t, "run", "--ttl", "2s", "--grace", "30s", b, a, "--", "sh", "-c", fmt.Sprintf(
				`trap 'echo "A term" >> %[1]q' TERM; sleep 60 & echo $! > %[2]q.tmp && mv %[2]q.tmp %[2]q; echo $$ > %[3]q.tmp && mv %[3]q.tmp %[3]q; i=0; while [ $i -lt 3000 ]; do echo A >> %[1]q; sleep 0.02; i=$((i+1)); done`,
				log, gpidfile, pidfile))
			pid, err := strconv.Atoi(strings.TrimSpace(readFile(t, pidfile)))
			require.NoError(t, err)
			gpid, err := strconv.Atoi(strings.TrimSpace(readFile(t, gpidfile)))
			require.NoError(t, err)
			t.Cleanup(func() {
				syscall.Kill(-pid, syscall.SIGKILL)
				syscall.Kill(gpid, syscall.SIGKILL)
			})
			second := start(t, "run", "--ttl", "2s", b, "--", "sh", "-c", fmt.Sprintf(`echo B >> %[1]q; sleep 0.3; echo B >> %[1]q`, log))
			waitKeys(t, b+"/", 2)
			require.Len(t, keys(t, a+"/"), 1)

			first.signal(t, tc.sig)
			require.Equal(t, 0, second.wait(t), "stderr: %s", second.stderr.String())
			bs, err := os.ReadFile(log)
			require.NoError(t, err)
			lines := strings.Split(strings.TrimSpace(string(bs)), "\n")
			firstB := slices.Index(lines, "B")
			require.Positive(t, firstB, "log %q", lines)
			require.NotContains(t, lines[firstB:], "A", "the first's command ran into the second's hold: %q", lines)
			require.Equal(t, tc.termLog, slices.Contains(lines, "A term"), "SIGTERM before SIGKILL: %q", lines)
			require.True(t, gone(pid), "the first's command %d outlived its hold", pid)
			require.True(t, gone(gpid), "the first's grandchild %d outlived its hold", gpid)
			if tc.sig == syscall.SIGSTOP {
				first.signal(t, syscall.SIGCONT)
				require.Equal(t, 137, first.wait(t), "stderr: %s", first.stderr.String())
				line := oneLine(t, first.stderr.String())
				require.Regexp(t, "lost the locks on "+a+", "+b+": ", line)
			} else {
				first.wait(t)
			}
			noKeys(t, a)
			noKeys(t, b)
		})
	}
}

// run --try A B when B is held (by a Mutex: etcdctl lock's key) exits 75,
// does not run the command, and writes nothing on either name.
func TestAttack28bRunTrySeveralNamesOneHeldWritesNothing(t *testing.T) {
	t.Parallel()
	base, dir := uniqueName(t), t.TempDir()
	a, b := base+"/a", base+"/b"
	holder, release := holding(t, dir, "run", b)
	held := keys(t, b+"/")
	require.Len(t, held, 1)
	code, p := run(t, "run", "--try", a, b, "--", "touch", filepath.Join(dir, "ran"))
	require.Equal(t, exitHeld, code, "stderr: %s", p.stderr.String())
	require.NoFileExists(t, filepath.Join(dir, "ran"))
	noKeys(t, a)
	after := keys(t, b+"/")
	require.Len(t, after, 1)
	require.Equal(t, held[0].ModRevision, after[0].ModRevision)
	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	noKeys(t, b)
}
