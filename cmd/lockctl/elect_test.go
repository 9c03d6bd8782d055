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
	eventually(t, func() bool { b, _ := os.ReadFile(log); return len(b) > 0 }, "a's command started")
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
