//go:build unix

package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
)

// The command never runs past its hold, whatever happens to lockctl. Each
// case starts a first lockctl (--ttl 2s, a --grace longer than the TTL)
// whose command ignores SIGTERM (it logs it), has a grandchild, and appends
// "A" to a shared log every 20ms; a second lockctl waits for the same name
// and appends "B" twice once it holds. When lockctl is killed (-9: its
// guard sends the group SIGTERM at once) or stopped (its guard hears nothing
// more), the guard kills the group at the session's local deadline, before
// etcd can expire the lease: no "A" follows the first "B", and the command
// and its grandchild are gone. A stopped lockctl, once continued, reports
// the loss in one line and exits 137, leaving nothing in etcd.
func TestGuardBoundsCommandByHold(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	for _, tc := range []struct {
		what    string
		cmd     []string // lockctl's arguments up to NAME
		args    string   // for the first, the second: after NAME, before --
		sig     syscall.Signal
		termLog bool // the guard's SIGTERM reaches the command
	}{
		{"run killed", []string{"run"}, "", syscall.SIGKILL, true},
		{"run stopped", []string{"run"}, "", syscall.SIGSTOP, false},
		{"elect killed", []string{"elect"}, "v", syscall.SIGKILL, true},
		{"elect stopped", []string{"elect"}, "v", syscall.SIGSTOP, false},
	} {
		t.Run(tc.what, func(t *testing.T) {
			t.Parallel()
			name, dir := uniqueName(t), t.TempDir()
			log := filepath.Join(dir, "log")
			pidfile, gpidfile := filepath.Join(dir, "pid"), filepath.Join(dir, "gpid")
			args := func(value string, script string) []string {
				a := append(slices.Clone(tc.cmd), "--ttl", "2s", "--grace", "30s", name)
				if tc.args != "" {
					a = append(a, value)
				}
				return append(a, "--", "sh", "-c", script)
			}
			first := start(t, args("first", fmt.Sprintf(
				`trap 'echo "A term" >> %[1]q' TERM; sleep 60 & echo $! > %[2]q.tmp && mv %[2]q.tmp %[2]q; echo $$ > %[3]q.tmp && mv %[3]q.tmp %[3]q; i=0; while [ $i -lt 3000 ]; do echo A >> %[1]q; sleep 0.02; i=$((i+1)); done`,
				log, gpidfile, pidfile))...)
			pid, err := strconv.Atoi(strings.TrimSpace(readFile(t, pidfile)))
			require.NoError(t, err)
			gpid, err := strconv.Atoi(strings.TrimSpace(readFile(t, gpidfile)))
			require.NoError(t, err)
			t.Cleanup(func() {
				syscall.Kill(-pid, syscall.SIGKILL)
				syscall.Kill(gpid, syscall.SIGKILL)
			})
			second := start(t, args("second", fmt.Sprintf(`echo B >> %[1]q; sleep 0.3; echo B >> %[1]q`, log))...)
			waitKeys(t, name+"/", 2)

			first.signal(t, tc.sig)
			require.Equal(t, 0, second.wait(t), "stderr: %s", second.stderr.String())
			b, err := os.ReadFile(log)
			require.NoError(t, err)
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			firstB := slices.Index(lines, "B")
			require.Positive(t, firstB, "log %q", lines)
			require.Contains(t, lines[:firstB], "A", "the first ran before the second")
			require.NotContains(t, lines[firstB:], "A", "the first's command ran into the second's hold: %q", lines)
			require.Equal(t, tc.termLog, slices.Contains(lines, "A term"), "SIGTERM before SIGKILL: %q", lines)
			require.True(t, gone(pid), "the first's command %d outlived its hold", pid)
			require.True(t, gone(gpid), "the first's grandchild %d outlived its hold", gpid)

			if tc.sig == syscall.SIGSTOP {
				first.signal(t, syscall.SIGCONT)
				require.Equal(t, 137, first.wait(t), "stderr: %s", first.stderr.String())
				line := oneLine(t, first.stderr.String())
				require.Regexp(t, "lost the (lock|leadership) on "+name+": ", line)
				require.Contains(t, line, "SIGKILL")
			} else {
				first.wait(t)
			}
			noKeys(t, name)
		})
	}
}

// runGuard runs lockctl's guard for argv (argv[0] the path) as lockctl
// starts it, with deadline first on its deadlines pipe, and returns its
// first record and its exit code, once it has exited (bounded by
// testTimeout).
func runGuard(t *testing.T, deadlines []time.Time, argv ...string) (guardRecord, int) {
	t.Helper()
	dr, dw, err := os.Pipe()
	require.NoError(t, err)
	defer dw.Close()
	rr, rw, err := os.Pipe()
	require.NoError(t, err)
	defer rr.Close()
	for _, d := range deadlines {
		require.NoError(t, writeDeadline(dw, d))
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	g := exec.CommandContext(ctx, bin, append([]string{guardArg, "1s"}, argv...)...)
	g.ExtraFiles = []*os.File{dr, rw}
	require.NoError(t, g.Start())
	dr.Close()
	rw.Close()
	records := make(chan guardRecord)
	go readRecords(rr, records)
	rec := <-records
	for range records { // to the guard's end
	}
	g.Wait()
	return rec, g.ProcessState.ExitCode()
}

// The guard never execs the command once the deadline it was given has
// passed (lockctl was stopped between the two, for instance): it reports
// "expired", and the command does not run.
func TestGuardDoesNotStartPastDeadline(t *testing.T) {
	t.Parallel()
	ran := filepath.Join(t.TempDir(), "ran")
	rec, code := runGuard(t, []time.Time{time.Now().Add(-time.Millisecond)}, "/usr/bin/touch", "touch", ran)
	require.Equal(t, recExpired, rec.kind)
	require.Equal(t, exitFailure, code)
	require.NoFileExists(t, ran)

	rec, code = runGuard(t, []time.Time{time.Now().Add(testTimeout)}, "/usr/bin/touch", "touch", ran)
	require.Equal(t, recStarted, rec.kind, "before the deadline it starts the command")
	require.Equal(t, 0, code)
	require.FileExists(t, ran)

	// A later deadline behind a passed one (the session's moved while the
	// guard started, under load): the latest counts, and the command runs.
	require.NoError(t, os.Remove(ran))
	rec, code = runGuard(t, []time.Time{time.Now().Add(-time.Millisecond), time.Now().Add(testTimeout)}, "/usr/bin/touch", "touch", ran)
	require.Equal(t, recStarted, rec.kind, "a later deadline behind a passed one")
	require.Equal(t, 0, code)
	require.FileExists(t, ran)
}

// The guard reports the errno its exec of the command failed with.
func TestGuardReportsExecErrno(t *testing.T) {
	t.Parallel()
	f := filepath.Join(t.TempDir(), "f")
	require.NoError(t, os.WriteFile(f, []byte("vm\n"), 0o755))
	rec, code := runGuard(t, []time.Time{time.Now().Add(testTimeout)}, f, f)
	require.Equal(t, recFailed, rec.kind)
	require.Equal(t, syscall.ENOEXEC, rec.errno, "%+v", rec)
	require.Contains(t, rec.msg, "exec format error")
	require.Equal(t, exitNoExec, code)
}

// lockctl run with several names (a MultiLock) never lets its command run
// past the hold, whatever happens to lockctl: killed (-9) or stopped while
// holding A and B, its guard kills the command's group by the session's
// deadline; a second lockctl waiting for B alone, which takes B once the
// lease expires, never sees an "A" after its first "B". The keys on both
// names are gone at the end.
func TestGuardBoundsSeveralNamesCommandByHold(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
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
