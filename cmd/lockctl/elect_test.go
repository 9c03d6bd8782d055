//go:build unix

package main

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

// elect runs its command only while leading: a second candidate's command
// starts only after the first ends. Without a command, elect leads until a
// signal, then resigns.
func TestElect(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	log := filepath.Join(dir, "log")
	script := func(id string) string {
		release := filepath.Join(dir, "release-"+id)
		return fmt.Sprintf(`echo "start %s $ETCDSYNC_KEY" >> %q; %s; echo "end %s" >> %q`, id, log, waitFor(release), id, log)
	}
	a := start(t, "elect", name, "a", "--", "sh", "-c", script("a"))
	readFile(t, log) // a's command started
	b := start(t, "elect", name, "b", "--", "sh", "-c", script("b"))
	kvs := waitKeys(t, name+"/", 2)
	require.Equal(t, "a", string(kvs[0].Value))
	require.Equal(t, "b", string(kvs[1].Value))
	logged, _ := os.ReadFile(log)
	require.Equal(t, fmt.Sprintf("start a %s\n", kvs[0].Key), string(logged), "b's command runs only once b leads")

	touch(t, filepath.Join(dir, "release-a"))
	require.Equal(t, 0, a.wait(t), "stderr: %s", a.stderr.String())
	eventually(t, func() bool { b, _ := os.ReadFile(log); return strings.Contains(string(b), "start b") }, "b's command after a resigned")
	touch(t, filepath.Join(dir, "release-b"))
	require.Equal(t, 0, b.wait(t), "stderr: %s", b.stderr.String())
	logged, _ = os.ReadFile(log)
	require.Equal(t, fmt.Sprintf("start a %s\nend a\nstart b %s\nend b\n", kvs[0].Key, kvs[1].Key), string(logged))
	noKeys(t, name)

	// Without a command: print the term, lead until SIGTERM, resign.
	c := start(t, "elect", name, "c")
	eventually(t, func() bool { return strings.HasSuffix(c.stdout.String(), "\n") }, "elect prints its term")
	kvs = waitKeys(t, name+"/", 1)
	require.Equal(t, fmt.Sprintf("%d %s %q\n", kvs[0].CreateRevision, kvs[0].Key, "c"), c.stdout.String())
	c.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, c.wait(t), "stderr: %s", c.stderr.String())
	require.Empty(t, c.stderr.String())
	noKeys(t, name)
}

// A revoked lease ends elect's leadership like run's lock.
func TestElectLoss(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	started, termed := filepath.Join(dir, "started"), filepath.Join(dir, "termed")
	p := start(t, "elect", name, "v", "--", "sh", "-c", trapTerm(started, termed))
	readFile(t, started)
	revokeHolder(t, name)
	readFile(t, termed)
	require.Equal(t, 143, p.wait(t), "stderr: %s", p.stderr.String())
	require.Contains(t, oneLine(t, p.stderr.String()), "lost the leadership on "+name)

	q := start(t, "elect", name, "w")
	eventually(t, func() bool { return q.stdout.String() != "" }, "elected")
	revokeHolder(t, name)
	require.Equal(t, exitFailure, q.wait(t))
	require.Contains(t, oneLine(t, q.stderr.String()), "lost the leadership on "+name)
	noKeys(t, name)
}

// observe prints one line per change of leader, and "no leader" when the
// election empties.
func TestObserve(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	obs := start(t, "observe", name)
	lines := func() []string {
		s := obs.stdout.String()
		if s == "" {
			return nil
		}
		return strings.Split(strings.TrimSuffix(s, "\n"), "\n")
	}
	waitLines := func(n int) []string {
		t.Helper()
		eventually(t, func() bool { return len(lines()) >= n }, "%d lines from observe, have %q", n, lines())
		return lines()
	}
	require.Equal(t, []string{"no leader"}, waitLines(1))

	// Two leaders in a row, the second while the first leads.
	dir := t.TempDir()
	release := filepath.Join(dir, "release")
	a := start(t, "elect", name, "value a", "--", "sh", "-c", waitFor(release))
	got := waitLines(2)
	kvs := waitKeys(t, name+"/", 1)
	a1 := fmt.Sprintf("%d %s %q", kvs[0].CreateRevision, kvs[0].Key, "value a")
	require.Equal(t, a1, got[1])
	b := start(t, "elect", name, "b", "--", "true")
	kvs = waitKeys(t, name+"/", 2)
	b1 := fmt.Sprintf("%d %s %q", kvs[1].CreateRevision, kvs[1].Key, "b")
	touch(t, release)
	require.Equal(t, 0, a.wait(t))
	require.Equal(t, 0, b.wait(t))
	require.Equal(t, []string{"no leader", a1, b1, "no leader"}, waitLines(4))

	// Then one more, after a gap.
	code, _ := run(t, "elect", name, "c", "--", "sh", "-c", `echo "$ETCDSYNC_REV $ETCDSYNC_KEY"`)
	require.Equal(t, 0, code)
	got = waitLines(6)
	require.True(t, strings.HasSuffix(got[4], ` "c"`), "%q", got)
	rev, err := strconv.ParseInt(strings.Fields(got[4])[0], 10, 64)
	require.NoError(t, err)
	require.Greater(t, rev, kvs[1].CreateRevision)
	require.Equal(t, "no leader", got[5])

	// Nothing more, and SIGTERM ends it with 0.
	time.Sleep(200 * time.Millisecond) // a stray line would show by now
	require.Len(t, lines(), 6)
	obs.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, obs.wait(t))
	require.Empty(t, obs.stderr.String())
}

// SIGTERM to a leading elect hands over: its command ends first, then it
// resigns, and the next candidate's command starts at once, long before the
// TTL (60 s) would have let it; never while the first command runs.
func TestElectSIGTERMHandsOver(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	log := filepath.Join(dir, "log")
	started := filepath.Join(dir, "started")
	a := start(t, "elect", "--ttl", "60s", name, "a", "--", "sh", "-c",
		fmt.Sprintf(`trap 'echo "end a" >> %q; exit 0' TERM; echo "start a" >> %q; touch %q; while :; do sleep 0.05; done`, log, log, started))
	eventually(t, func() bool { _, err := os.Stat(started); return err == nil }, "a's command started; stderr %s", a.stderr.String())
	b := start(t, "elect", "--ttl", "60s", name, "b", "--", "sh", "-c", fmt.Sprintf(`echo "start b" >> %q`, log))
	waitKeys(t, name+"/", 2)
	termed := time.Now()
	a.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, a.wait(t), "stderr: %s", a.stderr.String())
	require.Equal(t, 0, b.wait(t), "stderr: %s", b.stderr.String())
	require.Less(t, time.Since(termed), 30*time.Second, "b led only after a TTL")
	logged, _ := os.ReadFile(log)
	require.Equal(t, "start a\nend a\nstart b\n", string(logged))
	noKeys(t, name)
}

// elect --try exits 75 at once when someone leads, leaving no key.
func TestElectTry(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	a := start(t, "elect", name, "a")
	eventually(t, func() bool { return a.stdout.String() != "" }, "a leads")
	code, p := run(t, "elect", "--try", name, "b", "--", "true")
	require.Equal(t, exitHeld, code, "stderr: %s", p.stderr.String())
	require.Len(t, waitKeys(t, name+"/", 1), 1)
	a.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, a.wait(t))
	code, p = run(t, "elect", "--try", name, "b", "--", "true")
	require.Equal(t, 0, code, "stderr: %s", p.stderr.String())
	noKeys(t, name)
}

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
	etcdtest.SkipSlowInShort(t)
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
	etcdtest.SkipSlowInShort(t)
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
