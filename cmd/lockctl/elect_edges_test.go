//go:build unix

package main

// elect at its edges: a command that ignores SIGTERM, lockctl killed or
// frozen while leading, and --lock-delay after lost contact: the next
// candidate's command never runs while the last one's does.

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
)

// ticker is a command that writes the time (ns) to ticks every 50 ms until
// killed, ignoring SIGTERM when ignoreTerm, else exiting on it; started is
// written once it runs.
func ticker(ticks, started string, ignoreTerm bool) string {
	trap := `trap 'exit 0' TERM`
	if ignoreTerm {
		trap = `trap '' TERM`
	}
	return fmt.Sprintf(`exec 2>/dev/null; %s; echo x > %q; while :; do date +%%s%%N >> %q; sleep 0.05; done`, trap, started, ticks)
}

// stamp is a command that writes the time (ns) to path and exits.
func stamp(path string) string {
	return fmt.Sprintf(`date +%%s%%N > %q.tmp && mv %q.tmp %q`, path, path, path)
}

func nanos(t *testing.T, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	require.NoError(t, err, "%q", s)
	return n
}

// lastTick returns the last time written to ticks.
func lastTick(t *testing.T, ticks string) int64 {
	t.Helper()
	b, err := os.ReadFile(ticks)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return nanos(t, lines[len(lines)-1])
}

// noOverlap checks that the first command's last tick is before the second
// command started (bStart), once the first can tick no more.
func noOverlap(t *testing.T, ticks, bStart string) {
	t.Helper()
	b := nanos(t, readFile(t, bStart))
	time.Sleep(300 * time.Millisecond) // a command still running would tick by now
	last := lastTick(t, ticks)
	require.Less(t, last, b, "the first command ticked %v after the next one started", time.Duration(last-b))
}

// SIGTERM to elect whose command ignores it: the leadership stays (no
// successor) while the command runs; once it ends, the next candidate leads.
func TestElectSIGTERMWaitsForCommandThatIgnoresIt(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	ticks, started, bStart := filepath.Join(dir, "ticks"), filepath.Join(dir, "started"), filepath.Join(dir, "bstart")
	a := start(t, "elect", "--ttl", "60s", "--grace", "1s", name, "a", "--", "sh", "-c", ticker(ticks, started, true))
	readFile(t, started)
	b := start(t, "elect", "--ttl", "60s", name, "b", "--", "sh", "-c", stamp(bStart))
	waitKeys(t, name+"/", 2)
	a.signal(t, syscall.SIGTERM)
	time.Sleep(1500 * time.Millisecond) // past --grace: a loss's grace is not a signal's
	_, err := os.Stat(bStart)
	if err == nil {
		noOverlap(t, ticks, bStart)
		t.Fatalf("b led after a SIGTERM although a's command ignored it; a: %s", a.stderr.String())
	}
	// The command is still a's: a second SIGTERM, then SIGKILL of its group
	// by the test, ends it.
	pgid := commandGroup(t, name)
	require.NoError(t, syscall.Kill(-pgid, syscall.SIGKILL))
	a.wait(t)
	require.Equal(t, 0, b.wait(t), "stderr: %s", b.stderr.String())
	noOverlap(t, ticks, bStart)
	noKeys(t, name)
}

// commandGroup returns the process group of the command lockctl runs for
// name (from the ETCDSYNC_KEY in its environment is not needed: the
// command's sh is the only sh under a lockctl guard with the ticker).
func commandGroup(t *testing.T, name string) int {
	t.Helper()
	out, err := os.ReadDir("/proc")
	require.NoError(t, err)
	for _, e := range out {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil || !strings.Contains(string(env), "ETCDSYNC_NAME="+name+"\x00") {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if !strings.HasPrefix(string(cmdline), "sh\x00") {
			continue
		}
		pgid, err := syscall.Getpgid(pid)
		require.NoError(t, err)
		return pgid
	}
	t.Fatalf("no command of %s found", name)
	return 0
}

// lockctl killed (SIGKILL) or frozen (SIGSTOP) while leading: the next
// candidate leads once the lease expires, and the first command has been
// stopped by then (its guard), even one that ignores SIGTERM.
func TestElectKilledOrFrozenLeaderNoOverlap(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGSTOP} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			name, dir := uniqueName(t), t.TempDir()
			ticks, started, bStart := filepath.Join(dir, "ticks"), filepath.Join(dir, "started"), filepath.Join(dir, "bstart")
			a := start(t, "elect", "--ttl", "2s", "--grace", "30s", name, "a", "--", "sh", "-c", ticker(ticks, started, true))
			readFile(t, started)
			b := start(t, "elect", "--ttl", "2s", name, "b", "--", "sh", "-c", stamp(bStart))
			waitKeys(t, name+"/", 2)
			require.NoError(t, a.cmd.Process.Signal(sig))
			require.Equal(t, 0, b.wait(t), "stderr: %s", b.stderr.String())
			noOverlap(t, ticks, bStart)
			if sig == syscall.SIGSTOP {
				require.NoError(t, a.cmd.Process.Signal(syscall.SIGCONT))
				require.NotEqual(t, 0, a.wait(t), "a lost its leadership: %s", a.stderr.String())
			} else {
				a.wait(t)
			}
			noKeys(t, name)
		})
	}
}

// elect --lock-delay: when lockctl loses contact while leading, it stops the
// command at its local deadline, and the next candidate leads no sooner than
// the delay after that, also when contact comes back just after the loss
// (lockctl then closes its session on its way out).
func TestElectLockDelayAfterLostContactThenHealed(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	ticks, started, bStart := filepath.Join(dir, "ticks"), filepath.Join(dir, "started"), filepath.Join(dir, "bstart")
	proxy := etcdtest.NewProxy(t, strings.TrimPrefix(endpoint, "http://"))
	const delay = 6 * time.Second
	a := start(t, "--endpoints", proxy.Endpoint(), "elect", "--ttl", "2s", "--lock-delay", delay.String(), "--grace", "1s", name, "a", "--", "sh", "-c", ticker(ticks, started, false))
	readFile(t, started)
	b := start(t, "elect", name, "b", "--", "sh", "-c", stamp(bStart))
	waitKeys(t, name+"/", 2)
	proxy.Blackhole(true)
	t.Cleanup(func() { proxy.Blackhole(false) })
	// The command stops at a's local deadline.
	var stopped int64
	eventually(t, func() bool {
		last := lastTick(t, ticks)
		if time.Since(time.Unix(0, last)) > 500*time.Millisecond {
			stopped = last
			return true
		}
		return false
	}, "a's command stops")
	proxy.Blackhole(false) // contact comes back
	a.wait(t)
	require.Contains(t, oneLine(t, a.stderr.String()), "lost the leadership on "+name)
	require.Equal(t, 0, b.wait(t), "stderr: %s", b.stderr.String())
	got := time.Duration(nanos(t, readFile(t, bStart)) - stopped)
	require.GreaterOrEqual(t, got, delay-time.Second, "b led %v after a's command stopped (--lock-delay %v)", got, delay)
	noKeys(t, name)
}
