//go:build unix

package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// waitLine waits until b has a whole line that contains s, and returns it
// without its newline. It fails the test once done is closed (the writer
// has ended) without such a line, or after testTimeout.
func waitLine(t *testing.T, b *buffer, done <-chan struct{}, s string) string {
	t.Helper()
	timeout := time.After(testTimeout)
	for ended := false; ; {
		out, wrote := b.next()
		for _, line := range strings.SplitAfter(out, "\n") {
			if strings.HasSuffix(line, "\n") && strings.Contains(line, s) {
				return strings.TrimSuffix(line, "\n")
			}
		}
		if ended {
			t.Fatalf("no line with %q; it ended with %q", s, out)
		}
		select {
		case <-wrote:
		case <-done:
			ended = true
		case <-timeout:
			t.Fatalf("no line with %q within %v; so far %q", s, testTimeout, out)
		}
	}
}

// stderrLine waits until p's stderr has a line that contains s (see
// waitLine).
func (p *ctl) stderrLine(t *testing.T, s string) string {
	t.Helper()
	return waitLine(t, &p.stderr, p.done, s)
}

// lines splits s into its lines.
func lines(s string) []string { return strings.Split(strings.TrimSuffix(s, "\n"), "\n") }

// holderLine is how a waiting line names the holder kv.
func holderLine(kv *mvccpb.KeyValue) string {
	return fmt.Sprintf("held by %s (lease %x) since revision %d, value %q", kv.Key, kv.Lease, kv.CreateRevision, kv.Value)
}

// createdKeys reports the keys created under a prefix after it was made.
type createdKeys struct {
	wch     clientv3.WatchChan
	pending []*mvccpb.KeyValue
}

// watchCreates starts watching prefix for created keys; it returns once the
// watch is created (at most testTimeout). The watch ends with the test.
func watchCreates(t *testing.T, prefix string) *createdKeys {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w := &createdKeys{wch: admin.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithFilterDelete(), clientv3.WithCreatedNotify())}
	select {
	case wr := <-w.wch:
		require.True(t, wr.Created, "the watch of %s: %v", prefix, wr.Err())
	case <-time.After(testTimeout):
		t.Fatalf("the watch of %s was not created within %v", prefix, testTimeout)
	}
	return w
}

// next returns the next key created, waiting at most testTimeout.
func (w *createdKeys) next(t *testing.T) *mvccpb.KeyValue {
	t.Helper()
	timeout := time.After(testTimeout)
	for len(w.pending) == 0 {
		select {
		case wr, ok := <-w.wch:
			require.True(t, ok && !wr.Canceled, "the watch ended: %v", wr.Err())
			for _, ev := range wr.Events {
				if ev.IsCreate() {
					w.pending = append(w.pending, ev.Kv)
				}
			}
		case <-timeout:
			t.Fatalf("no key created within %v", testTimeout)
		}
	}
	kv := w.pending[0]
	w.pending = w.pending[1:]
	return kv
}

// gotLine matches the line that says lockctl got the hold what on names
// with keys of revision rev, after a wait.
func gotLine(what, names string, keys string, rev int64) *regexp.Regexp {
	return regexp.MustCompile(fmt.Sprintf(`^lockctl: got the %s on %s after [0-9.]+(ms|s|m[0-9.]+s): %s, revision %d$`,
		regexp.QuoteMeta(what), regexp.QuoteMeta(names), regexp.QuoteMeta(keys), rev))
}

// lockctl run says on stderr that it waits, naming the name, its place in
// the queue and the holder (key, lease, create revision, and value: the
// holding lockctl's host and pid); then that it got the lock, with its key
// and revision. Nothing more.
func TestRunSaysWhileWaiting(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	holder, release := holding(t, dir, "run", name)
	held := keys(t, name+"/")
	require.Len(t, held, 1)
	host, err := os.Hostname()
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("lockctl host=%s pid=%d", host, holder.cmd.Process.Pid), string(held[0].Value))

	p := start(t, "run", name, "--", "true")
	line := p.stderrLine(t, "waiting")
	require.Equal(t, fmt.Sprintf("lockctl: waiting for the lock on %s: place 1 in the queue, %s", name, holderLine(held[0])), line)
	kvs := keys(t, name+"/") // the waiting line came after the waiter's key
	require.Len(t, kvs, 2)
	require.Equal(t, held[0].Key, kvs[0].Key)
	ours := kvs[1]
	require.True(t, p.running())

	touch(t, release)
	require.Equal(t, 0, holder.wait(t), "stderr: %s", holder.stderr.String())
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
	require.Empty(t, holder.stderr.String(), "the holder did not wait")
	t.Logf("stderr:\n%s", p.stderr.String())
	got := lines(p.stderr.String())
	require.Len(t, got, 2, "stderr: %s", p.stderr.String())
	require.Equal(t, line, got[0])
	require.Regexp(t, gotLine("lock", name, "key "+string(ours.Key), ours.CreateRevision), got[1])
	noKeys(t, name)
}

// --quiet says nothing about the wait; a lockctl without it, queued behind
// the quiet one, does.
func TestRunQuietSaysNothing(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	holder, release := holding(t, dir, "run", name)
	held := keys(t, name+"/")
	require.Len(t, held, 1)
	created := watchCreates(t, name+"/")
	quiet := start(t, "run", "--quiet", name, "--", "true")
	created.next(t) // the quiet one waits
	loud := start(t, "run", name, "--", "true")
	line := loud.stderrLine(t, "waiting")
	require.Equal(t, fmt.Sprintf("lockctl: waiting for the lock on %s: place 2 in the queue, %s", name, holderLine(held[0])), line)

	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	require.Equal(t, 0, quiet.wait(t), "stderr: %s", quiet.stderr.String())
	require.Equal(t, 0, loud.wait(t), "stderr: %s", loud.stderr.String())
	require.Empty(t, quiet.stderr.String())
	require.Len(t, lines(loud.stderr.String()), 2, "waiting, got: %s", loud.stderr.String())
	noKeys(t, name)
}

// elect says that it waits for the leadership, with the leader's value
// (the candidate's own); an RWMutex's writer names the first of the readers
// that hold and how many more do; a semaphore's waiter its holder, whose
// value is its permits; with several names, lockctl says which name it
// waits for, and the got line gives every key.
func TestSaysWhileWaitingEveryKind(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		what    string
		holders [][]string // the args before the name of each holder
		held    string     // the holders' name, after the test's base name
		waiter  []string   // the args before the names
		names   []string   // the waiter's names, after the base name; nil: the base name
		hold    string     // the hold, as the lines say it
		more    string     // after the holder, in the waiting line
	}{
		{what: "election", holders: [][]string{{"elect"}}, waiter: []string{"elect"}, hold: "leadership"},
		{what: "write", holders: [][]string{{"run", "--read"}, {"run", "--read"}}, waiter: []string{"run", "--write"}, hold: "write lock", more: ", and 1 more"},
		{what: "semaphore", holders: [][]string{{"run", "--sem", "1"}}, waiter: []string{"run", "--sem", "1"}, hold: "semaphore permits (1 of 1)"},
		{what: "several names", holders: [][]string{{"run"}}, held: "/b", waiter: []string{"run"}, names: []string{"/b", "/a"}, hold: "locks"},
	} {
		t.Run(tc.what, func(t *testing.T) {
			t.Parallel()
			base, dir := uniqueName(t), t.TempDir()
			release := filepath.Join(dir, "release")
			heldName := base + tc.held
			var holders []*ctl
			for i, args := range tc.holders {
				args = append(append([]string{}, args...), heldName)
				if args[0] == "elect" {
					args = append(args, fmt.Sprint("holder-", i))
				}
				started := filepath.Join(dir, fmt.Sprint("started-", i))
				holders = append(holders, start(t, append(args, "--", "sh", "-c", fmt.Sprintf("echo x > %q; %s", started, waitFor(release)))...))
				readFile(t, started) // it holds, with its value written
			}
			held := keys(t, heldName+"/")
			require.Len(t, held, len(tc.holders))

			names := []string{base}
			if tc.names != nil {
				names = nil
				for _, n := range tc.names {
					names = append(names, base+n)
				}
			}
			args := append(append([]string{}, tc.waiter...), names...)
			if args[0] == "elect" {
				args = append(args, "waiter")
			}
			p := start(t, append(args, "--", "true")...)
			hold := tc.hold
			if len(names) > 1 {
				hold = "lock"
			}
			line := p.stderrLine(t, "waiting")
			require.Equal(t, fmt.Sprintf("lockctl: waiting for the %s on %s: place 1 in the queue, %s%s", hold, heldName, holderLine(held[0]), tc.more), line)
			var ours []string // the waiter's keys, in name order
			sorted := slices.Sorted(slices.Values(names))
			for _, n := range sorted {
				kvs := keys(t, n+"/")
				ours = append(ours, string(kvs[len(kvs)-1].Key))
			}
			rev := keys(t, sorted[0]+"/")
			k := "key "
			if len(names) > 1 {
				k = "keys "
			}

			touch(t, release)
			for _, h := range holders {
				require.Equal(t, 0, h.wait(t), "stderr: %s", h.stderr.String())
			}
			require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
			t.Logf("stderr:\n%s", p.stderr.String())
			got := lines(p.stderr.String())
			require.Len(t, got, 2, "stderr: %s", p.stderr.String())
			require.Regexp(t, gotLine(tc.hold, strings.Join(sorted, ", "), k+strings.Join(ours, ", "), rev[len(rev)-1].CreateRevision), got[1])
			for _, n := range names {
				noKeys(t, n)
			}
		})
	}
}

// While it waits longer than the report's period, lockctl says that it
// still waits, for how long and behind whom, each period; after it holds,
// its line says so. (In process, with a first read after 50ms rather than
// a second, and a period of 100ms rather than a minute.)
func TestWaitReportSaysStillWaiting(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	holder, release := holding(t, dir, "run", name)
	held := keys(t, name+"/")
	require.Len(t, held, 1)

	cli, err := clientv3.New(etcdtest.ClientConfig([]string{endpoint}))
	require.NoError(t, err)
	defer cli.Close()
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(5*time.Second))
	require.NoError(t, err)
	defer s.Close()
	m := etcdsync.NewMutex(s, name)

	var out buffer
	stopped := make(chan struct{})
	rep := startWaitReport(&out, cli, s.Lease(), []string{name}, "lock", testTimeout, 50*time.Millisecond, 100*time.Millisecond)
	defer rep.stop()
	locked := make(chan error, 1)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	go func() { locked <- m.Lock(ctx) }()

	first := waitLine(t, &out, stopped, "lockctl: waiting")
	require.Equal(t, fmt.Sprintf("lockctl: waiting for the lock on %s: place 1 in the queue, %s", name, holderLine(held[0])), first)
	still := waitLine(t, &out, stopped, "still waiting")
	require.Regexp(t, fmt.Sprintf(`^lockctl: still waiting for the lock on %s after [0-9.]+m?s: place 1 in the queue, %s$`,
		regexp.QuoteMeta(name), regexp.QuoteMeta(holderLine(held[0]))), still)

	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	select {
	case err := <-locked:
		require.NoError(t, err)
	case <-time.After(testTimeout):
		t.Fatalf("not locked within %v", testTimeout)
	}
	waited, took := rep.stop()
	close(stopped)
	require.True(t, waited)
	rep.got(took, []string{m.Key()}, m.Rev())
	t.Logf("said:\n%s", out.String())
	got := lines(out.String())
	require.Regexp(t, gotLine("lock", name, "key "+m.Key(), m.Rev()), got[len(got)-1])
	for _, l := range got[:len(got)-1] {
		if l != first {
			require.Contains(t, l, "lockctl: still waiting for the lock on "+name+" after ")
		}
	}
	uctx, ucancel := context.WithTimeout(context.Background(), testTimeout)
	defer ucancel()
	require.NoError(t, m.Unlock(uctx))
}

// placeOf numbers the waiters of the key's own queue (the direct children,
// or an RWMutex's keys) from 1 and lists that queue's holders.
func TestPlaceOf(t *testing.T) {
	t.Parallel()
	es := []etcdsync.Entry{ // as Holders lists them: the direct children, then an RWMutex's
		{Key: "n/a", Rev: 10, Lease: 0xa, Held: true, Kind: "exclusive", Value: []byte("x")},
		{Key: "n/b", Rev: 11, Lease: 0xb, Kind: "exclusive"},
		{Key: "n/f", Rev: 15, Lease: 0xf, Kind: "exclusive"},
		{Key: "n/read/c", Rev: 12, Lease: 0xc, Held: true, Kind: "read"},
		{Key: "n/read/d", Rev: 13, Lease: 0xd, Held: true, Kind: "read"},
		{Key: "n/write/e", Rev: 14, Lease: 0xe, Kind: "write"},
		{Key: "n/read/g", Rev: 16, Lease: 0x10, Kind: "read"},
	}
	for _, tc := range []struct {
		lease clientv3.LeaseID
		want  string
	}{
		{0xf, `place 2 in the queue, held by n/a (lease a) since revision 10, value "x"`},
		{0xb, `place 1 in the queue, held by n/a (lease a) since revision 10, value "x"`},
		{0xe, `place 1 in the queue, held by n/read/c (lease c) since revision 12, and 1 more`},
		{0x10, `place 2 in the queue, held by n/read/c (lease c) since revision 12, and 1 more`},
	} {
		p := placeOf(es, tc.lease)
		require.NotNil(t, p.ours, "lease %x", tc.lease)
		require.False(t, p.ours.Held)
		require.Equal(t, tc.want, p.String(), "lease %x", tc.lease)
	}
	require.Nil(t, placeOf(es, 0x99).ours)
	require.Equal(t, "place 1 in the queue, held by nobody now", placeOf(es[1:2], 0xb).String())
}
