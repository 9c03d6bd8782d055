package tests

// Shards: every shard runs on exactly one member at a time, balanced over
// the members (floor or ceil of n/m each), sticky (a join moves only what
// the newcomer takes, a leave only the leaver's shards), with a fencing
// token per shard that grows from one owner to the next; a fn slow to stop
// delays the move and never overlaps its successor; a failing fn runs
// again; bad arguments and a disagreeing n are refused.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// shardTracker records which member runs which shard, checks that no shard
// ever runs on two members at once and that each shard's fencing token
// grows from one run to the next, and counts moves (a shard starting on a
// member other than its last one).
type shardTracker struct {
	t    testing.TB
	stop time.Duration // how long a fn takes to return once its ctx ended

	mu      sync.Mutex
	owner   map[int]string // shard -> member running it now
	last    map[int]string // shard -> member that ran it last
	token   map[int]int64  // shard -> the last run's fencing token
	moves   int
	moved   int // runs whose ctx ended with a move's cause (ErrLockReleased)
	overlap []string
	changed chan struct{} // closed and replaced at each change
}

func newShardTracker(t testing.TB, stop time.Duration) *shardTracker {
	return &shardTracker{t: t, stop: stop, owner: map[int]string{}, last: map[int]string{}, token: map[int]int64{}, changed: make(chan struct{})}
}

// fn returns a Shards function for member: it records its run until its
// ctx ends, then takes tr.stop to return.
func (tr *shardTracker) fn(member string) func(ctx context.Context, shard int) error {
	return func(ctx context.Context, shard int) error {
		key, rev, ok := etcdsync.HoldFrom(ctx)
		tr.mu.Lock()
		if o, busy := tr.owner[shard]; busy {
			tr.overlap = append(tr.overlap, fmt.Sprintf("shard %d on %s and %s", shard, o, member))
		}
		if !ok || !strings.Contains(key, fmt.Sprintf("/%d/", shard)) {
			tr.overlap = append(tr.overlap, fmt.Sprintf("shard %d: HoldFrom gave %q, %v", shard, key, ok))
		}
		if rev <= tr.token[shard] {
			tr.overlap = append(tr.overlap, fmt.Sprintf("shard %d: token %d after %d", shard, rev, tr.token[shard]))
		}
		if l, ran := tr.last[shard]; ran && l != member {
			tr.moves++
		}
		tr.owner[shard], tr.last[shard], tr.token[shard] = member, member, rev
		tr.notifyLocked()
		tr.mu.Unlock()
		<-ctx.Done()
		time.Sleep(tr.stop) // a fn slow to stop: the work it finishes (not a synchronisation)
		tr.mu.Lock()
		if errors.Is(context.Cause(ctx), etcdsync.ErrLockReleased) {
			tr.moved++
		}
		delete(tr.owner, shard)
		tr.notifyLocked()
		tr.mu.Unlock()
		return ctx.Err()
	}
}

func (tr *shardTracker) notifyLocked() {
	close(tr.changed)
	tr.changed = make(chan struct{})
}

// counts returns how many shards each member runs now.
func (tr *shardTracker) countsLocked() map[string]int {
	c := map[string]int{}
	for _, m := range tr.owner {
		c[m]++
	}
	return c
}

// waitBalanced waits, at most d, until all n shards run, on the members
// named (all of them when there are as many shards), each with floor or
// ceil of n/len(members).
func (tr *shardTracker) waitBalanced(n int, members []string, d time.Duration) {
	tr.t.Helper()
	deadline := time.After(d)
	for {
		tr.mu.Lock()
		c, ok := tr.countsLocked(), len(tr.owner) == n
		for m, k := range c {
			lo := n / len(members)
			ok = ok && k >= lo && k <= lo+min(1, n%len(members)) && slices.Contains(members, m)
		}
		ok = ok && len(c) == min(n, len(members)) // with fewer shards than members, some run none
		ch := tr.changed
		tr.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			tr.mu.Lock()
			defer tr.mu.Unlock()
			tr.t.Fatalf("not balanced over %v within %v: %d of %d shards run, by member %v", members, d, len(tr.owner), n, tr.countsLocked())
		}
	}
}

// check fails the test on an overlap or a token that did not grow.
func (tr *shardTracker) check() {
	tr.t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	require.Empty(tr.t, tr.overlap)
}

// take returns and resets a count of tr (moves, or runs told of a move).
func (tr *shardTracker) take(count *int) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	n := *count
	*count = 0
	return n
}

// shardMember is a member's Run in flight.
type shardMember struct {
	name   string
	cancel context.CancelFunc
	res    <-chan error
}

func startMember(t testing.TB, s *etcdsync.Session, name, member string, n int, tr *shardTracker, opts ...etcdsync.ShardsOption) *shardMember {
	ctx, cancel := context.WithCancel(context.Background())
	sh := etcdsync.NewShards(s, name, n, opts...)
	res := make(chan error, 1)
	m := &shardMember{name: member, cancel: cancel, res: res}
	done := make(chan struct{})
	go func() {
		defer close(done)
		err := sh.Run(ctx, tr.fn(member))
		if ctx.Err() == nil {
			t.Logf("%s: Run returned before its context ended: %v", member, err)
		}
		res <- err
	}()
	t.Cleanup(func() { cancel(); <-done })
	return m
}

// stop ends a member's Run and checks it returned the context's error.
func (m *shardMember) stopRun(t *testing.T) {
	t.Helper()
	m.cancel()
	require.ErrorIs(t, resultWithin(t, m.res, testTimeout, "Run of "+m.name), context.Canceled)
}

// Three members share 12 shards 4 each; a fourth joins and takes 3 (only
// those move), then one leaves and its 3 go to the others (only those
// move): every shard on one member at a time, tokens growing. Its keys are
// gone once its Run returned.
func TestShardsBalanceAndStickyMoves(t *testing.T) {
	t.Parallel()
	c, admin, _ := singleClient(t)
	const name, n = "shards-balance", 12
	tr := newShardTracker(t, 0)
	var ms []*shardMember
	for i := range 3 {
		ms = append(ms, startMember(t, session(t, c.Client(t)), name, fmt.Sprintf("m%d", i), n, tr))
	}
	tr.waitBalanced(n, []string{"m0", "m1", "m2"}, testTimeout)
	tr.check()
	tr.take(&tr.moves)
	tr.take(&tr.moved)
	ms = append(ms, startMember(t, session(t, c.Client(t)), name, "m3", n, tr))
	tr.waitBalanced(n, []string{"m0", "m1", "m2", "m3"}, testTimeout)
	require.Equal(t, 3, tr.take(&tr.moves), "shards moved by a join to 12 shards on 3 members")
	require.Equal(t, 3, tr.take(&tr.moved), "runs told of their shard's move (context.Cause wraps ErrLockReleased)")
	ms[1].stopRun(t)
	tr.waitBalanced(n, []string{"m0", "m2", "m3"}, testTimeout)
	require.Equal(t, 3, tr.take(&tr.moves), "shards moved by a leave")
	tr.check()
	resp, err := admin.Get(ctxT(t), name+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 3+n, "3 members and 12 shards' keys")
	owners, err := etcdsync.ShardOwners(ctxT(t), admin, name, n)
	require.NoError(t, err)
	require.Len(t, owners, n)
	for i, o := range owners {
		require.True(t, o.Held, "shard %d", i)
		require.True(t, strings.HasPrefix(o.Key, etcdsync.ShardName(name, i)+"/"), "shard %d's key %s", i, o.Key)
		require.Contains(t, string(o.Value), "n=12 ", "shard %d's member value", i)
		tr.mu.Lock()
		token := tr.token[i]
		tr.mu.Unlock()
		require.Equal(t, token, o.Rev, "shard %d's token", i)
	}
}

// A fn that takes 300 ms to stop delays its shard's move and never
// overlaps the next owner: members join and leave while every fn is slow.
func TestShardsSlowFnNeverOverlaps(t *testing.T) {
	t.Parallel()
	c, _, _ := singleClient(t)
	const name, n = "shards-slow", 8
	tr := newShardTracker(t, 300*time.Millisecond)
	a := startMember(t, session(t, c.Client(t)), name, "a", n, tr)
	tr.waitBalanced(n, []string{"a"}, testTimeout)
	startMember(t, session(t, c.Client(t)), name, "b", n, tr)
	tr.waitBalanced(n, []string{"a", "b"}, testTimeout)
	startMember(t, session(t, c.Client(t)), name, "c", n, tr)
	tr.waitBalanced(n, []string{"a", "b", "c"}, testTimeout)
	a.stopRun(t)
	tr.waitBalanced(n, []string{"b", "c"}, testTimeout)
	tr.check()
}

// A fn that fails runs again on its member after a pause, and its errors
// are counted; Run goes on.
func TestShardsFailingFnRunsAgain(t *testing.T) {
	t.Parallel()
	c, _, ctx := singleClient(t)
	const name = "shards-fail"
	runs := make(chan int, 16)
	sh := etcdsync.NewShards(session(t, c.Client(t)), name, 1)
	rctx, cancel := context.WithCancel(ctx)
	res := async(func() error {
		return sh.Run(rctx, func(ctx context.Context, shard int) error {
			runs <- shard
			return errors.New("the work failed")
		})
	})
	for range 3 {
		select {
		case <-runs:
		case <-time.After(testTimeout):
			t.Fatal("the failing fn did not run again")
		}
	}
	cancel()
	require.ErrorIs(t, resultWithin(t, res, testTimeout, "Run"), context.Canceled)
}

// Bad arguments are refused with nothing written; a member asking for
// another n than the running members is refused and disturbs nobody.
func TestShardsRefuseBadArgumentsAndAnotherN(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	s := session(t, c.Client(t))
	fn := func(ctx context.Context, shard int) error { <-ctx.Done(); return nil }
	require.ErrorIs(t, etcdsync.NewShards(s, "shards-bad", 0).Run(ctx, fn), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewShards(s, "shards-bad", 3).Run(ctx, nil), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewShards(s, "", 3).Run(ctx, fn), etcdsync.ErrInvalidName)
	require.ErrorIs(t, etcdsync.NewShards(nil, "shards-bad", 3).Run(ctx, fn), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewShards(s, "shards-bad", 3, etcdsync.WithMaxShards(-1)).Run(ctx, fn), etcdsync.ErrInvalidArgument)
	require.Empty(t, keys(t, admin, "shards-bad/"))

	tr := newShardTracker(t, 0)
	startMember(t, session(t, c.Client(t)), "shards-n", "four", 4, tr)
	tr.waitBalanced(4, []string{"four"}, testTimeout)
	err := etcdsync.NewShards(session(t, c.Client(t)), "shards-n", 5).Run(ctx, fn)
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	require.ErrorContains(t, err, "5 shards")
	require.ErrorContains(t, err, "n=4")
	tr.waitBalanced(4, []string{"four"}, testTimeout)
	require.Zero(t, tr.take(&tr.moves))
}

// A cap: a member WithMaxShards(2) holds 2 of 9, the other two share the
// remaining 7 (4 and 3).
func TestShardsCapPerMember(t *testing.T) {
	t.Parallel()
	c, _, _ := singleClient(t)
	const name, n = "shards-cap", 9
	tr := newShardTracker(t, 0)
	startMember(t, session(t, c.Client(t)), name, "small", n, tr, etcdsync.WithMaxShards(2))
	startMember(t, session(t, c.Client(t)), name, "b", n, tr)
	startMember(t, session(t, c.Client(t)), name, "c", n, tr)
	deadline := time.After(testTimeout)
	for {
		tr.mu.Lock()
		cnt, all := tr.countsLocked(), len(tr.owner) == n
		ch := tr.changed
		tr.mu.Unlock()
		if all && cnt["small"] == 2 && cnt["b"]+cnt["c"] == 7 && max(cnt["b"], cnt["c"]) == 4 {
			break
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("shares with a cap of 2: %v", cnt)
		}
	}
	tr.check()
}

// A member whose link goes silent: its fns end (its session's end) before
// anyone else starts its shards, its Run returns ErrSessionExpired, and the
// others take its shards.
func TestShardsMemberWithSilentLink(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c, _, _ := singleClient(t)
	const name, n = "shards-silent", 6
	tr := newShardTracker(t, 0)
	rig := newSilentRig(t, c)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sh := etcdsync.NewShards(session(t, rig.cli, etcdsync.WithTTL(2*time.Second)), name, n)
	res := async(func() error { return sh.Run(ctx, tr.fn("cut")) })
	startMember(t, session(t, c.Client(t)), name, "b", n, tr)
	tr.waitBalanced(n, []string{"cut", "b"}, testTimeout)
	rig.proxy.Blackhole(true)
	require.ErrorIs(t, resultWithin(t, res, testTimeout, "the cut member's Run"), etcdsync.ErrSessionExpired)
	tr.waitBalanced(n, []string{"b"}, testTimeout)
	tr.check()
}

// How long n shards over m members take to settle (every shard running,
// each member with floor or ceil of its share) after a member joins, after
// it leaves again (its Run's context ends), and after a member running
// shards dies (its link goes silent: the server ends its session 10 to 15 s
// later, within the TTL and the slack of its last renewal), and what all
// members' clients spend on each: unary RPCs and watch events. One client
// and one session per member; the members that may die (the first, and the
// one that replaces each dead one) reach etcd through a proxy of their own,
// the others directly (30 busy proxies in one process starve each other's
// keepalives: the proxy is test code).
// Without -scale it runs one size only (n = 12, m = 3), as CI does.
func BenchmarkShardsSettle(b *testing.B) {
	ns, ms := []int{12}, []int{3}
	if *scaleFull {
		ns, ms = []int{12, 256, 4096}, []int{3, 30}
	}
	for _, n := range ns {
		for _, m := range ms {
			b.Run(fmt.Sprintf("n=%d/m=%d", n, m), func(b *testing.B) { benchShardsSettle(b, n, m) })
		}
	}
}

func benchShardsSettle(b *testing.B, n, m int) {
	const (
		name  = "bench-shards"
		ttl   = 15 * time.Second // 60 s (the default) makes the dead case slow; with 5 s, 30 members starting on 4096 shards lost sessions here
		bound = time.Minute      // a settle that takes longer fails the benchmark
	)
	c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
	tr := newShardTracker(b, 0)
	var cnt counter
	var members []string // in join order
	links := map[string]*etcdtest.Proxy{}
	running := map[string]*shardMember{}
	memberSession := func(member string, proxied bool) *etcdsync.Session {
		cli := c.Client(b, cnt.dial()...)
		if proxied {
			links[member] = etcdtest.NewProxy(b, strings.TrimPrefix(c.Member(0).Endpoint(), "http://"))
			cli = etcdtest.NewClient(b, []string{links[member].Endpoint()}, cnt.dial()...)
		}
		return session(b, cli, etcdsync.WithTTL(ttl))
	}
	join := func(member string, s *etcdsync.Session) {
		members = append(members, member)
		running[member] = startMember(b, s, name, member, n, tr)
	}
	without := func(member string) {
		members = slices.DeleteFunc(members, func(x string) bool { return x == member })
	}
	first := make([]*etcdsync.Session, m) // the sessions first: the members' start loads the server
	for i := range m {
		first[i] = memberSession(fmt.Sprintf("m%d", i), i == 0)
	}
	for i, s := range first {
		join(fmt.Sprintf("m%d", i), s)
		if i == 0 { // the first in join order, so that it runs a shard (the one that may die)
			tr.waitBalanced(n, members, bound)
		}
	}
	tr.waitBalanced(n, members, bound)
	const joined, left, died = 0, 1, 2
	var took [3]time.Duration
	var rpcs, events [3]int64
	measure := func(k int, act func()) {
		cnt.take()
		e := cnt.events.Load()
		start := time.Now()
		act()
		tr.waitBalanced(n, members, bound)
		took[k] += time.Since(start)
		r, _ := cnt.take()
		rpcs[k] += r
		events[k] += cnt.events.Load() - e
	}
	b.ResetTimer()
	for i := range b.N {
		newcomer := fmt.Sprintf("j%d", i)
		s := memberSession(newcomer, false)
		measure(joined, func() { join(newcomer, s) })
		measure(left, func() { without(newcomer); running[newcomer].cancel() })
		tr.mu.Lock()
		counts := tr.countsLocked()
		tr.mu.Unlock()
		victim := ""
		for _, x := range members {
			if links[x] != nil && counts[x] > 0 {
				victim = x
			}
		}
		if victim == "" {
			b.Fatalf("no member that may die runs a shard: %v", counts)
		}
		measure(died, func() { without(victim); links[victim].Blackhole(true) })
		b.StopTimer()
		links[victim].Blackhole(false)
		join(fmt.Sprintf("r%d", i), memberSession(fmt.Sprintf("r%d", i), true)) // back to m members
		tr.waitBalanced(n, members, bound)
		b.StartTimer()
	}
	b.StopTimer()
	for k, what := range []string{"join", "leave", "dead"} {
		b.ReportMetric(float64(took[k].Milliseconds())/float64(b.N), "ms/"+what)
		b.ReportMetric(float64(rpcs[k])/float64(b.N), "rpcs/"+what)
		b.ReportMetric(float64(events[k])/float64(b.N), "events/"+what)
	}
	tr.check()
}
