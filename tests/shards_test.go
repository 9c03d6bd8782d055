package tests

// Shards: every shard runs on exactly one member at a time, balanced over
// the members (floor or ceil of n/m each), sticky (a join moves only what
// the newcomer takes, a leave only the leaver's shards), with a fencing
// token per shard that grows from one owner to the next; a fn slow to stop
// delays the move and never overlaps its successor; a failing fn runs
// again; bad arguments and a disagreeing n are refused (the name's n is its
// oldest member's; a refused member disturbs nobody while it is listed); a
// try found locked is tried again once a newer view shows the shard free;
// tries that fail otherwise are paced.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
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
	return tr.fnStopping(member, func(int) time.Duration { return tr.stop })
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
	return startMemberFn(t, s, name, member, n, tr.fn(member), opts...)
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

// hookedKV runs hook around the first Txn whose compares or ops touch a key
// under prefix once armed: before(), the commit, after().
type hookedKV struct {
	clientv3.KV
	mu            sync.Mutex
	prefix        []byte
	before, after func()
}

func (k *hookedKV) arm(prefix string, before, after func()) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.prefix, k.before, k.after = []byte(prefix), before, after
}

func (k *hookedKV) Txn(ctx context.Context) clientv3.Txn {
	return &hookedTxn{Txn: k.KV.Txn(ctx), kv: k}
}

type hookedTxn struct {
	clientv3.Txn
	kv      *hookedKV
	touches bool
}

func (t *hookedTxn) mark(key []byte) {
	t.kv.mu.Lock()
	defer t.kv.mu.Unlock()
	if t.kv.prefix != nil && bytes.HasPrefix(key, t.kv.prefix) {
		t.touches = true
	}
}

func (t *hookedTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	for i := range cs {
		t.mark(cs[i].KeyBytes())
	}
	t.Txn = t.Txn.If(cs...)
	return t
}

func (t *hookedTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	for _, op := range ops {
		t.mark(op.KeyBytes())
	}
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *hookedTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	for _, op := range ops {
		t.mark(op.KeyBytes())
	}
	t.Txn = t.Txn.Else(ops...)
	return t
}

func (t *hookedTxn) Commit() (*clientv3.TxnResponse, error) {
	var before, after func()
	if t.touches {
		t.kv.mu.Lock()
		before, after = t.kv.before, t.kv.after
		t.kv.prefix, t.kv.before, t.kv.after = nil, nil, nil
		t.kv.mu.Unlock()
	}
	if before != nil {
		before()
	}
	resp, err := t.Txn.Commit()
	if after != nil {
		after()
	}
	return resp, err
}

// seenWatcher signals on deleted each time a watch response with a delete of
// a key under prefix has been handed to its reader.
type seenWatcher struct {
	clientv3.Watcher
	prefix  string
	deleted chan struct{}
}

func (w *seenWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	in := w.Watcher.Watch(ctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		for wr := range in {
			del := false
			for _, ev := range wr.Events {
				del = del || ev.Type == clientv3.EventTypeDelete && bytes.HasPrefix(ev.Kv.Key, []byte(w.prefix))
			}
			select {
			case out <- wr:
				if del {
					select {
					case w.deleted <- struct{}{}:
					default:
					}
				}
			case <-ctx.Done():
			}
		}
	}()
	return out
}

// A try that finds its shard locked is tried again once a view newer than
// the one it started from shows the shard free, also when the loop already
// has that view as the try's answer comes (the holder released it between
// the try and its answer): the shard does not stay unheld until something
// else under the name changes.
func TestShardsTryFoundLockedRetriesOnceFreed(t *testing.T) {
	c, admin, ctx := singleClient(t)
	const name, n = "shards-freed", 2
	shard1 := etcdsync.ShardName(name, 1)
	foreign := heldMutex(t, ctx, admin, shard1) // an operator holds shard 1 (lockctl)
	cli := c.Client(t)
	kv := &hookedKV{KV: cli.KV}
	cli.KV = kv
	sw := &seenWatcher{Watcher: cli.Watcher, prefix: shard1 + "/", deleted: make(chan struct{}, 1)}
	cli.Watcher = sw
	tr := newShardTracker(t, 0)
	startMember(t, session(t, cli), name, "a", n, tr)
	tr.waitRuns("a", 1, testTimeout)
	// The member's try of shard 1 finds it held by a second foreign hold
	// (taken just before it); that hold is released, and the member's view
	// shows the release, before the try's answer reaches it.
	again := etcdsync.NewMutex(session(t, admin), shard1)
	kv.arm(shard1+"/", func() {
		require.NoError(t, again.Lock(ctx))
	}, func() {
		<-sw.deleted // the first release's event, already seen
		require.NoError(t, again.Unlock(ctx))
		select {
		case <-sw.deleted:
		case <-time.After(testTimeout):
			t.Error("the release's event never reached the member")
		}
		time.Sleep(100 * time.Millisecond) // the answer's delay
	})
	require.NoError(t, foreign.Unlock(ctx))
	tr.waitRuns("a", 2, 10*time.Second)
	tr.check()
}

// A member with another n that joins in a race (its read before its join
// saw no member) is refused, and while it is still listed the running
// member leaves it out of its plan: none of its shards stops.
func TestShardsRefusedRacerDisturbsNobody(t *testing.T) {
	c, _, ctx := singleClient(t)
	const name, n = "shards-racen", 4
	tr := newShardTracker(t, 0)
	cli := c.Client(t)
	kv := &hookedKV{KV: cli.KV}
	cli.KV = kv
	kv.arm(name+"/members/", func() { // y's join: o joins first
		startMember(t, session(t, c.Client(t)), name, "o", n, tr)
		tr.waitBalanced(n, []string{"o"}, testTimeout)
	}, func() {
		time.Sleep(500 * time.Millisecond) // y's join answer is slow
	})
	err := etcdsync.NewShards(session(t, cli), name, 5).Run(ctx, tr.fn("y"))
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	tr.waitBalanced(n, []string{"o"}, testTimeout)
	require.Zero(t, tr.take(&tr.moved), "o's runs stopped while the refused member was listed")
}

// The name's n is its oldest member's: while a refused member is still
// listed (its join's answer is slow; or its process died before it left,
// for its TTL), a newcomer with the running members' n joins and runs.
func TestShardsRefusedMemberRefusesNobodyElse(t *testing.T) {
	c, _, ctx := singleClient(t)
	const name, n = "shards-racen2", 4
	tr := newShardTracker(t, 0)
	cli := c.Client(t)
	kv := &hookedKV{KV: cli.KV}
	cli.KV = kv
	var zerr error
	kv.arm(name+"/members/", func() {
		startMember(t, session(t, c.Client(t)), name, "o", n, tr)
		tr.waitBalanced(n, []string{"o"}, testTimeout)
	}, func() {
		// y is listed now: z, with o's n, starts; it ends its Run once it
		// runs a shard.
		zctx, cancel := context.WithCancel(ctx)
		defer cancel()
		zerr = etcdsync.NewShards(session(t, c.Client(t)), name, n).Run(zctx, func(fctx context.Context, shard int) error {
			cancel()
			<-fctx.Done()
			return nil
		})
	})
	err := etcdsync.NewShards(session(t, cli), name, 5).Run(ctx, tr.fn("y"))
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, zerr, context.Canceled, "z, with the running n")
}

// A try that fails with an error other than ErrLocked (here the server's
// NOSPACE alarm: every write refused at once) is tried again after a
// pause: a member short of 2 shards does not send thousands of Txns a
// second to a server in trouble (3,000 in 1 s without the pause).
func TestShardsTriesThatFailArePaced(t *testing.T) {
	c, _, ctx := singleClient(t)
	const name, n = "shards-nospace", 4
	tr := newShardTracker(t, 0)
	var cnt counter
	startMember(t, session(t, c.Client(t, cnt.dial()...)), name, "a", n, tr)
	tr.waitRuns("a", 1, testTimeout)
	b := startMember(t, session(t, c.Client(t)), name, "b", n, tr)
	tr.waitBalanced(n, []string{"a", "b"}, testTimeout)
	mc := pb.NewMaintenanceClient(etcdtest.Conn(t, c.Member(0).Endpoint()))
	alarm := &pb.AlarmRequest{Action: pb.AlarmRequest_ACTIVATE, MemberID: c.Member(0).ID(), Alarm: pb.AlarmType_NOSPACE}
	_, err := mc.Alarm(ctx, alarm)
	require.NoError(t, err)
	t.Cleanup(func() {
		alarm.Action = pb.AlarmRequest_DEACTIVATE
		mc.Alarm(context.Background(), alarm)
	})
	b.stopRun(t) // a is short of b's 2 shards, and every try fails
	cnt.take()
	time.Sleep(time.Second) // the window measured
	rpcs, _ := cnt.take()
	require.Less(t, rpcs, int64(100), "a's RPCs in 1 s with every try failing") // 3,000 here
}

// waitRuns waits, at most d, until member runs at least k shards.
func (tr *shardTracker) waitRuns(member string, k int, d time.Duration) {
	tr.t.Helper()
	deadline := time.After(d)
	for {
		tr.mu.Lock()
		have := tr.countsLocked()[member]
		ch := tr.changed
		tr.mu.Unlock()
		if have >= k {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			tr.t.Fatalf("%s runs %d shards after %v, want %d", member, have, d, k)
		}
	}
}

// --- Attacks on Shards: churn, paused and dead members, cluster faults,
// caps, n = 1, failing fns, tries stopped in flight.

// fnStopping is tr.fn with a stop time per shard: stop(shard) is how long
// the fn takes to return once its ctx ended.
func (tr *shardTracker) fnStopping(member string, stop func(shard int) time.Duration) func(ctx context.Context, shard int) error {
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
		time.Sleep(stop(shard)) // the work it finishes (not a synchronisation)
		tr.mu.Lock()
		if errors.Is(context.Cause(ctx), etcdsync.ErrLockReleased) {
			tr.moved++
		}
		if tr.owner[shard] == member { // not the run after an overlap
			delete(tr.owner, shard)
		}
		tr.notifyLocked()
		tr.mu.Unlock()
		return ctx.Err()
	}
}

// noStop is a stop time of 0: fns return as soon as their ctx ends.
func noStop(int) time.Duration { return 0 }

// slowStop is a stop time of 200, 300 or 400 ms, by shard.
func slowStop(shard int) time.Duration { return time.Duration(200+100*(shard%3)) * time.Millisecond }

// waitCounts waits, at most d, until ok holds for the shards each member
// runs now; t fails with the counts when d passes first.
func (tr *shardTracker) waitCounts(d time.Duration, what string, ok func(counts map[string]int, running int) bool) {
	tr.t.Helper()
	deadline := time.After(d)
	for {
		tr.mu.Lock()
		c, running := tr.countsLocked(), len(tr.owner)
		ch := tr.changed
		tr.mu.Unlock()
		if ok(c, running) {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			tr.t.Fatalf("%s: not within %v: %d shards run, by member %v", what, d, running, c)
		}
	}
}

// counts returns how many shards each member runs now.
func (tr *shardTracker) counts() map[string]int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.countsLocked()
}

// checkBut fails the test on a token that did not grow, or an overlap that
// does not involve member (whose hold someone else ended: an admin's
// revoke ends a hold on the server before its fn can know).
func (tr *shardTracker) checkBut(member string) {
	tr.t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, o := range tr.overlap {
		if !strings.Contains(o, " on "+member+" and ") && !strings.HasSuffix(o, " and "+member) {
			tr.t.Errorf("%s", o)
		}
	}
}

// startMemberFn is startMember with a fn of the caller's.
func startMemberFn(t testing.TB, s *etcdsync.Session, name, member string, n int, fn func(context.Context, int) error, opts ...etcdsync.ShardsOption) *shardMember {
	ctx, cancel := context.WithCancel(context.Background())
	sh := etcdsync.NewShards(s, name, n, opts...)
	res := make(chan error, 1)
	m := &shardMember{name: member, cancel: cancel, res: res}
	done := make(chan struct{})
	go func() {
		defer close(done)
		err := sh.Run(ctx, fn)
		if ctx.Err() == nil {
			t.Logf("%s: Run returned before its context ended: %v", member, err)
		}
		res <- err
	}()
	t.Cleanup(func() { cancel(); <-done })
	return m
}

// proxiedSession returns a session of a client that reaches c's first
// member through a proxy of its own (to cut its link), with opts.
func proxiedSession(t *testing.T, c *etcdtest.Cluster, member int, opts ...etcdsync.SessionOption) (*etcdsync.Session, *etcdtest.Proxy) {
	t.Helper()
	p := etcdtest.NewProxy(t, strings.TrimPrefix(c.Member(member).Endpoint(), "http://"))
	cli := etcdtest.NewClient(t, []string{p.Endpoint()})
	t.Cleanup(func() { p.Blackhole(false) })
	return session(t, cli, opts...), p
}

// cutMemberAmongThree starts three members of name's n shards on a single
// member: "cut", on a session (TTL 2 s) through link, whose fns take
// cutStop to stop, then "b" and "c", whose fns are slow to stop
// (slowStop); it returns once the three are balanced.
func cutMemberAmongThree(t *testing.T, name string, n int, cutStop func(int) time.Duration) (*shardTracker, *etcdsync.Session, *etcdtest.Proxy, *shardMember) {
	t.Helper()
	c, _, _ := singleClient(t)
	tr := newShardTracker(t, 0)
	cs, link := proxiedSession(t, c, 0, etcdsync.WithTTL(2*time.Second))
	cut := startMemberFn(t, cs, name, "cut", n, tr.fnStopping("cut", cutStop))
	tr.waitRuns("cut", 1, testTimeout)
	startMemberFn(t, session(t, c.Client(t)), name, "b", n, tr.fnStopping("b", slowStop))
	startMemberFn(t, session(t, c.Client(t)), name, "c", n, tr.fnStopping("c", slowStop))
	tr.waitBalanced(n, []string{"cut", "b", "c"}, testTimeout)
	return tr, cs, link, cut
}

// Churn with fns that take 200 to 400 ms to stop: three members start at
// once, a fourth leaves as soon as it runs its first shard (its other
// tries in flight), a fifth leaves as it joins, two join while the oldest
// and then the next leave in the middle of moves. No shard ever runs on
// two members at once, tokens grow, every Run returns context.Canceled,
// none of a leaver's keys is left once its Run returned, the last four
// balance once the churn stops, and no key is left.
func TestShardsChurnWithSlowFnsNeverOverlaps(t *testing.T) {
	t.Parallel()
	c, admin, _ := singleClient(t)
	const name, n = "shards-churn", 16
	tr := newShardTracker(t, 0)
	ms := map[string]*shardMember{}
	leases := map[string]clientv3.LeaseID{}
	start := func(m string) {
		s := session(t, c.Client(t))
		leases[m] = s.Lease()
		ms[m] = startMemberFn(t, s, name, m, n, tr.fnStopping(m, slowStop))
	}
	noKeysOf := func(m string) { // once its Run returned
		t.Helper()
		for _, k := range keys(t, admin, name+"/") {
			require.False(t, strings.HasSuffix(k, fmt.Sprintf("/%x", int64(leases[m]))), "%s's key %s after its Run returned", m, k)
		}
	}
	for _, m := range []string{"m0", "m1", "m2"} {
		start(m)
	}
	tr.waitRuns("m2", 1, testTimeout)
	start("m3")
	tr.waitRuns("m3", 1, testTimeout)
	ms["m3"].cancel() // leaves with tries in flight
	start("m4")
	start("m5")
	waitKeys(t, admin, name+"/members/", 5)
	ms["m5"].cancel() // leaves as it joins
	tr.waitRuns("m4", 1, testTimeout)
	ms["m0"].cancel() // the oldest leaves while m4 takes its share
	start("m6")
	tr.waitRuns("m6", 1, testTimeout)
	ms["m1"].cancel()
	start("m7")
	for _, m := range []string{"m0", "m1", "m3", "m5"} {
		require.ErrorIs(t, resultWithin(t, ms[m].res, testTimeout, "Run of "+m), context.Canceled)
		noKeysOf(m)
	}
	tr.waitBalanced(n, []string{"m2", "m4", "m6", "m7"}, testTimeout)
	tr.check()
	for _, m := range []string{"m2", "m4", "m6", "m7"} {
		ms[m].stopRun(t)
	}
	tr.check()
	require.Empty(t, tr.counts(), "fns still running after every Run returned")
	require.Empty(t, keys(t, admin, name+"/"))
}

// Tries stopped before they took their lock, many times: a member alone
// on 32 shards retakes what a newcomer gave back while the next newcomer
// joins (it stops its highest shards, tries in flight among them), 20
// times; then two members join and all three reach their share (a try
// count left behind would keep a member short), with one key per shard and
// per member.
func TestShardsStoppedTriesKeepMembersTakingTheirShare(t *testing.T) {
	t.Parallel()
	c, admin, _ := singleClient(t)
	const name, n = "shards-stop-trying", 32
	tr := newShardTracker(t, 0)
	startMember(t, session(t, c.Client(t)), name, "a", n, tr)
	tr.waitBalanced(n, []string{"a"}, testTimeout)
	for i := range 20 {
		m := fmt.Sprintf("b%d", i)
		b := startMember(t, session(t, c.Client(t)), name, m, n, tr)
		waitKeys(t, admin, name+"/members/", 2)
		b.cancel()
		require.ErrorIs(t, resultWithin(t, b.res, testTimeout, "Run of "+m), context.Canceled)
	}
	startMember(t, session(t, c.Client(t)), name, "b", n, tr)
	startMember(t, session(t, c.Client(t)), name, "c", n, tr)
	tr.waitBalanced(n, []string{"a", "b", "c"}, testTimeout)
	tr.check()
	require.Len(t, keys(t, admin, name+"/"), 3+n)
}

// A member whose link is silent for 1 s or so, less than its session's
// TTL (5 s), while a third member joins: it keeps every shard it runs (its fns
// go on, nobody else starts them; the newcomer takes only what the member
// that can see it gives), and once the link is back it gives the newcomer
// its part: fns slow to stop, no overlap, two moves in all (what the
// newcomer takes), the paused member's session alive throughout.
func TestShardsPausedLinkShorterThanTTLKeepsShards(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c, _, _ := singleClient(t)
	const name, n = "shards-paused", 8
	tr := newShardTracker(t, 0)
	ps, link := proxiedSession(t, c, 0, etcdsync.WithTTL(5*time.Second))
	p := startMemberFn(t, ps, name, "p", n, tr.fnStopping("p", slowStop))
	tr.waitBalanced(n, []string{"p"}, testTimeout) // then b takes from it, no try racing p's
	startMemberFn(t, session(t, c.Client(t)), name, "b", n, tr.fnStopping("b", slowStop))
	tr.waitBalanced(n, []string{"p", "b"}, testTimeout)
	tr.take(&tr.moves)
	tr.mu.Lock()
	var mine []int
	for i, o := range tr.owner {
		if o == "p" {
			mine = append(mine, i)
		}
	}
	tr.mu.Unlock()
	cs := session(t, c.Client(t))
	link.Blackhole(true)
	silent := time.Now()
	startMemberFn(t, cs, name, "c", n, tr.fnStopping("c", slowStop))
	tr.waitRuns("c", 1, testTimeout)                // b's part (targets 3, 3, 2)
	time.Sleep(time.Until(silent.Add(time.Second))) // the pause: 1 s at least
	tr.mu.Lock()
	during := map[int]string{}
	for _, i := range mine {
		during[i] = tr.owner[i]
	}
	tr.mu.Unlock()
	link.Blackhole(false)
	for _, i := range mine {
		require.Equal(t, "p", during[i], "shard %d during the pause", i)
	}
	tr.waitBalanced(n, []string{"p", "b", "c"}, testTimeout)
	tr.check()
	require.Equal(t, 2, tr.take(&tr.moves), "shards the newcomer took")
	require.NoError(t, ps.Err())
	p.stopRun(t)
}

// A member whose link goes silent for good, while every fn takes 200 to
// 400 ms to stop: its session tells it first, so every one of its fns has
// returned before its Run returns ErrSessionExpired, and before any other
// member starts its shards; the others then share them.
func TestShardsSilentLinkEndsSlowFnsBeforeOthersStart(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	const n = 9
	tr, _, link, cut := cutMemberAmongThree(t, "shards-silent-slow", n, slowStop)
	link.Blackhole(true)
	require.ErrorIs(t, resultWithin(t, cut.res, testTimeout, "the cut member's Run"), etcdsync.ErrSessionExpired)
	require.Zero(t, tr.counts()["cut"], "fns of the cut member still running after its Run returned")
	tr.waitBalanced(n, []string{"b", "c"}, testTimeout)
	tr.check()
}

// A member's link silent until its session's local deadline, then back
// while its fns, told at the deadline, take 1 s to stop, and its session
// closed then (as a program that replaces an ended session does, from
// another goroutine; seed 1795924073491773223 of the robustness run, whose
// lock worker shared the session): Close waits for the fns before its
// revoke frees the shards, so nobody starts one of them before they
// returned.
func TestShardsSessionClosedWhileFnsStopNeverOverlaps(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	const n = 9
	tr, cs, link, cut := cutMemberAmongThree(t, "shards-closed-stopping", n, func(int) time.Duration { return time.Second })
	link.Blackhole(true)
	select {
	case <-cs.Done(): // the local deadline: every fn of the member is told now
	case <-time.After(testTimeout):
		t.Fatalf("the cut member's session did not end within %v", testTimeout)
	}
	require.ErrorIs(t, cs.Err(), etcdsync.ErrLostContact)
	require.NotZero(t, tr.counts()["cut"], "no fn of the cut member still stopping when the link came back")
	link.Blackhole(false)
	require.NoError(t, cs.Close())
	require.Zero(t, tr.counts()["cut"], "Close returned with fns of the member still running")
	require.ErrorIs(t, resultWithin(t, cut.res, testTimeout, "the cut member's Run"), etcdsync.ErrSessionExpired)
	tr.waitBalanced(n, []string{"b", "c"}, testTimeout)
	tr.check()
}

// A member whose lease an admin revokes while a newcomer takes its part
// from it (tries in flight): its Run returns an error wrapping ErrNotHeld
// (its member key's delete comes first: 10 of 10 runs here) or
// ErrSessionExpired, the other two share all shards, and every token
// grows. (A revoke frees the keys on the server before the member can
// know: a fn of its may still be stopping when another member starts its
// shard; that overlap is the revoke's, and fencing tokens guard it.)
func TestShardsRevokedMemberMidMove(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name, n = "shards-revoked", 12
	tr := newShardTracker(t, 0)
	ds := session(t, c.Client(t))
	d := startMemberFn(t, ds, name, "d", n, tr.fnStopping("d", noStop))
	tr.waitRuns("d", 1, testTimeout)
	startMemberFn(t, session(t, c.Client(t)), name, "b", n, tr.fnStopping("b", noStop))
	tr.waitBalanced(n, []string{"d", "b"}, testTimeout)
	startMemberFn(t, session(t, c.Client(t)), name, "c", n, tr.fnStopping("c", noStop))
	tr.waitRuns("c", 1, testTimeout)
	_, err := admin.Revoke(ctx, ds.Lease())
	require.NoError(t, err)
	// Its Run ends on the first sign: its member key gone (ErrNotHeld,
	// the session often not knowing yet) or its session's end.
	derr := resultWithin(t, d.res, testTimeout, "the revoked member's Run")
	require.True(t, errors.Is(derr, etcdsync.ErrNotHeld) || errors.Is(derr, etcdsync.ErrSessionExpired), "the revoked member's Run: %v", derr)
	tr.waitBalanced(n, []string{"b", "c"}, testTimeout)
	tr.checkBut("d")
	require.Len(t, keys(t, admin, name+"/"), 2+n)
}

// A member orphaned (its session ended without a revoke, as a process
// that hands its lease over) while a newcomer takes its part and its fns
// take 200 to 400 ms to stop: its fns end and its Run returns
// ErrSessionClosed; its keys stay until the server expires the lease, so
// nobody starts its shards before its fns returned; then the others share
// them.
func TestShardsOrphanedMemberMidMoveNeverOverlaps(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c, admin, _ := singleClient(t)
	const name, n = "shards-orphaned", 12
	tr := newShardTracker(t, 0)
	orphan := session(t, c.Client(t), etcdsync.WithTTL(2*time.Second))
	o := startMemberFn(t, orphan, name, "o", n, tr.fnStopping("o", slowStop))
	tr.waitRuns("o", 1, testTimeout)
	startMemberFn(t, session(t, c.Client(t)), name, "b", n, tr.fnStopping("b", slowStop))
	tr.waitBalanced(n, []string{"o", "b"}, testTimeout)
	startMemberFn(t, session(t, c.Client(t)), name, "c", n, tr.fnStopping("c", slowStop))
	tr.waitRuns("c", 1, testTimeout)
	orphan.Orphan()
	require.ErrorIs(t, resultWithin(t, o.res, testTimeout, "the orphaned member's Run"), etcdsync.ErrSessionClosed)
	require.Zero(t, tr.counts()["o"], "fns of the orphaned member still running after its Run returned")
	tr.waitBalanced(n, []string{"b", "c"}, testTimeout)
	tr.check()
	require.Len(t, keys(t, admin, name+"/"), 2+n)
}

// On a 3-member etcd cluster, the raft leader stops (Stop: etcd hands its
// leadership over on the way) while a newcomer takes its part from members
// whose fns take 200 to 400 ms to stop: no shard runs on two members at
// once, tokens grow, and the three members balance; then one leaves and
// the other two take its shards. A long run: the stop alone takes 6 to 13
// s here (etcd's graceful stop).
func TestShardsClusterLeaderStopsWhileShardsMove(t *testing.T) {
	long(t)
	t.Parallel()
	c := three(t)
	const name, n = "shards-leader", 12
	tr := newShardTracker(t, 0)
	ms := map[string]*shardMember{}
	for _, m := range []string{"a", "b"} {
		ms[m] = startMemberFn(t, session(t, c.Client(t)), name, m, n, tr.fnStopping(m, slowStop))
		tr.waitRuns(m, 1, testTimeout)
	}
	tr.waitBalanced(n, []string{"a", "b"}, testTimeout)
	ms["c"] = startMemberFn(t, session(t, c.Client(t)), name, "c", n, tr.fnStopping("c", slowStop))
	tr.waitRuns("c", 1, testTimeout) // a move under way
	leader := c.Leader()
	require.NotNil(t, leader)
	c.Stop(leader)
	tr.waitBalanced(n, []string{"a", "b", "c"}, testTimeout)
	require.NoError(t, c.Restart(leader))
	ms["a"].stopRun(t)
	tr.waitBalanced(n, []string{"b", "c"}, testTimeout)
	tr.check()
}

// On a 3-member etcd cluster, the raft leader, which one Shards member
// talks to, is cut off from its peers while shards move (fns slow to
// stop): the other two etcd members elect a leader and carry on; the cut
// member's session ends before the cluster frees its keys, so each of its
// fns returns before another member starts its shard; its Run returns
// ErrSessionExpired, and the two other members take every shard.
func TestShardsClusterLeaderCutOffWhileShardsMove(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	etcdtest.SkipClusterInShort(t, 3)
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	const name, n = "shards-leader-cut", 9
	leader := c.Leader()
	require.NotNil(t, leader)
	var others []string
	for _, m := range c.Members() {
		if m != leader {
			others = append(others, m.Endpoint())
		}
	}
	tr := newShardTracker(t, 0)
	vs := session(t, etcdtest.NewClient(t, []string{leader.Endpoint()}), etcdsync.WithTTL(2*time.Second))
	v := startMemberFn(t, vs, name, "v", n, tr.fnStopping("v", slowStop))
	tr.waitRuns("v", 1, testTimeout)
	startMemberFn(t, session(t, etcdtest.NewClient(t, others)), name, "a", n, tr.fnStopping("a", slowStop))
	tr.waitBalanced(n, []string{"v", "a"}, testTimeout)
	startMemberFn(t, session(t, etcdtest.NewClient(t, others)), name, "b", n, tr.fnStopping("b", slowStop))
	tr.waitRuns("b", 1, testTimeout) // a move under way
	require.NoError(t, c.CutPeers(leader))
	t.Cleanup(func() { c.HealPeers(leader) })
	require.ErrorIs(t, resultWithin(t, v.res, testTimeout, "the cut-off member's Run"), etcdsync.ErrSessionExpired)
	require.Zero(t, tr.counts()["v"], "fns of the cut-off member still running after its Run returned")
	tr.waitBalanced(n, []string{"a", "b"}, testTimeout)
	tr.check()
}

// fnRuns records, per member, the shards its fn ran (each call), for fns
// that return at once; changed is closed and replaced at each call.
type fnRuns struct {
	mu      sync.Mutex
	runs    map[string]map[int]int // member -> shard -> calls
	changed chan struct{}
}

func newFnRuns() *fnRuns {
	return &fnRuns{runs: map[string]map[int]int{}, changed: make(chan struct{})}
}

// failing returns a fn for member that records its call and fails.
func (r *fnRuns) failing(member string) func(ctx context.Context, shard int) error {
	return func(ctx context.Context, shard int) error {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.runs[member] == nil {
			r.runs[member] = map[int]int{}
		}
		r.runs[member][shard]++
		close(r.changed)
		r.changed = make(chan struct{})
		return fmt.Errorf("shard %d on %s: the work failed", shard, member)
	}
}

// wait waits, at most d, until ok holds for the calls recorded.
func (r *fnRuns) wait(t *testing.T, d time.Duration, what string, ok func(runs map[string]map[int]int) bool) {
	t.Helper()
	deadline := time.After(d)
	for {
		r.mu.Lock()
		done, ch := ok(r.runs), r.changed
		r.mu.Unlock()
		if done {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			r.mu.Lock()
			defer r.mu.Unlock()
			t.Fatalf("%s: not within %v: runs %v", what, d, r.runs)
		}
	}
}

// Fns that fail at once, forever, run again after growing pauses and do
// not hold moves up: a member alone on 6 shards fails each 3 times (its
// next pause 800 ms), a second member joins and runs its 3 shards, and
// ShardOwners shows 3 on each; every Run returns context.Canceled.
func TestShardsFailingFnsStillMoveAndBalance(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name, n = "shards-failing", 6
	runs := newFnRuns()
	as, bs := session(t, c.Client(t)), session(t, c.Client(t))
	actx, acancel := context.WithCancel(ctx)
	ares := async(func() error { return etcdsync.NewShards(as, name, n).Run(actx, runs.failing("a")) })
	runs.wait(t, testTimeout, "a's fns failing 3 times each", func(r map[string]map[int]int) bool {
		for i := range n {
			if r["a"][i] < 3 {
				return false
			}
		}
		return true
	})
	bctx, bcancel := context.WithCancel(ctx)
	bres := async(func() error { return etcdsync.NewShards(bs, name, n).Run(bctx, runs.failing("b")) })
	runs.wait(t, testTimeout, "b running 3 shards", func(r map[string]map[int]int) bool { return len(r["b"]) == 3 })
	owners, err := etcdsync.ShardOwners(ctx, admin, name, n)
	require.NoError(t, err)
	byLease := map[clientv3.LeaseID]int{}
	for i, o := range owners {
		require.True(t, o.Held, "shard %d", i)
		byLease[o.Lease]++
	}
	require.Equal(t, map[clientv3.LeaseID]int{as.Lease(): 3, bs.Lease(): 3}, byLease)
	runs.mu.Lock()
	var onB []int
	for i := range runs.runs["b"] {
		onB = append(onB, i)
	}
	runs.mu.Unlock()
	for _, i := range onB {
		require.Equal(t, bs.Lease(), owners[i].Lease, "shard %d ran on b", i)
	}
	acancel()
	bcancel()
	require.ErrorIs(t, resultWithin(t, ares, testTimeout, "a's Run"), context.Canceled)
	require.ErrorIs(t, resultWithin(t, bres, testTimeout, "b's Run"), context.Canceled)
	require.Empty(t, keys(t, admin, name+"/"))
}

// Caps mixed with no cap (WithMaxShards(0)): 6 shards over a (cap 1), b
// (none), c (cap 2), d (cap 1) in join order run 1, 2, 2, 1; when b
// leaves, the others have no room for its 2 shards, which stay unheld;
// a newcomer with no cap takes exactly those 2 and nobody else's shard
// is stopped for it.
func TestShardsCapsLeaveShardsForAnUncappedNewcomer(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name, n = "shards-caps-mix", 6
	tr := newShardTracker(t, 0)
	caps := []struct {
		member string
		cap    int
	}{{"a", 1}, {"b", 0}, {"c", 2}, {"d", 1}}
	ms := map[string]*shardMember{}
	for i, mc := range caps {
		ms[mc.member] = startMember(t, session(t, c.Client(t)), name, mc.member, n, tr, etcdsync.WithMaxShards(mc.cap))
		waitKeys(t, admin, name+"/members/", i+1) // join order
	}
	want := func(w map[string]int) func(map[string]int, int) bool {
		return func(c map[string]int, running int) bool {
			total := 0
			for _, k := range w {
				total += k
			}
			if running != total || len(c) != len(w) {
				return false
			}
			for m, k := range w {
				if c[m] != k {
					return false
				}
			}
			return true
		}
	}
	tr.waitCounts(testTimeout, "shares 1, 2, 2, 1", want(map[string]int{"a": 1, "b": 2, "c": 2, "d": 1}))
	ms["b"].stopRun(t)
	tr.waitCounts(testTimeout, "b's shards unheld", want(map[string]int{"a": 1, "c": 2, "d": 1}))
	owners, err := etcdsync.ShardOwners(ctx, admin, name, n)
	require.NoError(t, err)
	held := 0
	for _, o := range owners {
		if o.Held {
			held++
		}
	}
	require.Equal(t, 4, held, "shards held with no room for the rest")
	tr.take(&tr.moved)
	startMember(t, session(t, c.Client(t)), name, "e", n, tr, etcdsync.WithMaxShards(0))
	tr.waitCounts(testTimeout, "e takes the 2 unheld shards", want(map[string]int{"a": 1, "c": 2, "d": 1, "e": 2}))
	require.Zero(t, tr.take(&tr.moved), "runs stopped for the newcomer")
	tr.check()
}

// One shard and five members: it runs on the oldest; joins and the leave
// of a member that does not run it move nothing; when its member leaves,
// the next oldest runs it (one move).
func TestShardsOneShardRunsOnTheOldestMember(t *testing.T) {
	t.Parallel()
	c, admin, _ := singleClient(t)
	const name, n = "shards-one", 1
	tr := newShardTracker(t, 0)
	ms := map[string]*shardMember{}
	on := func(member string) func(map[string]int, int) bool {
		return func(c map[string]int, running int) bool { return running == 1 && c[member] == 1 }
	}
	for i := range 5 {
		m := fmt.Sprintf("m%d", i)
		ms[m] = startMember(t, session(t, c.Client(t)), name, m, n, tr)
		waitKeys(t, admin, name+"/members/", i+1)
		tr.waitCounts(testTimeout, "the shard on m0", on("m0"))
	}
	ms["m3"].stopRun(t)
	waitCount(t, admin, name+"/members/", testTimeout, func(have int) bool { return have == 4 })
	tr.waitCounts(testTimeout, "the shard on m0", on("m0"))
	require.Zero(t, tr.take(&tr.moves), "moves before its member leaves")
	ms["m0"].stopRun(t)
	tr.waitCounts(testTimeout, "the shard on m1", on("m1"))
	require.Equal(t, 1, tr.take(&tr.moves))
	tr.check()
}

// A process restarted with its old lease (Orphan, then WithLease: the
// documented hand-over) runs the shards it held: it deletes the old holds
// of its lease, which nobody else may take, and takes them again, with new
// fencing tokens.
func TestShardsRestartWithAdoptedLeaseRunsItsShards(t *testing.T) {
	t.Parallel()
	c, admin, _ := singleClient(t)
	const name, n = "shards-adopt", 4
	tr := newShardTracker(t, 0)
	s1 := session(t, c.Client(t), etcdsync.WithTTL(10*time.Second))
	a := startMember(t, s1, name, "a", n, tr)
	tr.waitBalanced(n, []string{"a"}, testTimeout)
	s1.Orphan() // the process hands over: its lease and keys live on
	require.ErrorIs(t, resultWithin(t, a.res, testTimeout, "Run"), etcdsync.ErrSessionClosed)
	require.Len(t, keys(t, admin, name+"/"), n+1, "the shards' holds and the member's key, left to the lease")
	s2 := session(t, c.Client(t), etcdsync.WithLease(s1.Lease()))
	startMember(t, s2, name, "a2", n, tr)
	tr.waitBalanced(n, []string{"a2"}, testTimeout)
	tr.check()
}

// A member over its share after a join stops its in-flight tries before
// any running shard: here its try of shard 0 (which an operator takes back
// meanwhile, so the try fails) is in flight when a newcomer joins; the
// member must stop only the one run the newcomer takes, not also a running
// shard that it then takes again.
func TestShardsOverShareStopsTriesFirst(t *testing.T) {
	c, admin, ctx := singleClient(t)
	const name, n = "shards-stop-tries-first", 4
	shard0 := etcdsync.ShardName(name, 0)
	foreign := heldMutex(t, ctx, admin, shard0) // an operator holds shard 0
	cli := c.Client(t)
	kv := &hookedKV{KV: cli.KV}
	cli.KV = kv
	tr := newShardTracker(t, 0)
	startMember(t, session(t, cli), name, "p", n, tr)
	tr.waitRuns("p", 3, testTimeout)
	trying, resume := make(chan struct{}), make(chan struct{})
	kv.arm(shard0+"/", func() { close(trying); <-resume }, nil)
	tr.take(&tr.moved)
	require.NoError(t, foreign.Unlock(ctx))
	within(t, trying, testTimeout, "p's try of shard 0")
	again := etcdsync.NewMutex(session(t, admin), shard0)
	require.NoError(t, again.Lock(ctx))                       // the operator takes it back: p's try will fail
	startMember(t, session(t, c.Client(t)), name, "b", n, tr) // targets 2, 2
	deadline := time.AfterFunc(testTimeout, func() { close(resume) })
	tr.waitRuns("b", 1, testTimeout)
	if deadline.Stop() {
		close(resume)
	}
	tr.waitCounts(testTimeout, "p 2, b 1 (shard 0 is the operator's)", func(c map[string]int, running int) bool {
		return c["p"] == 2 && c["b"] == 1 && running == 3
	})
	tr.check()
	require.Equal(t, 1, tr.take(&tr.moved), "runs stopped for b's join (b takes 1 of p's 3)")
}

// A member whose lease an admin revokes: its session ended, so its Run
// returns an error wrapping ErrSessionExpired (as Run's doc says), not
// ErrNotHeld (someone deleted its member key).
func TestShardsRevokedLeaseEndsRunWithSessionExpired(t *testing.T) {
	c, admin, ctx := singleClient(t)
	const name, n = "shards-revoked-err", 4
	tr := newShardTracker(t, 0)
	s := session(t, c.Client(t))
	m := startMember(t, s, name, "m", n, tr)
	tr.waitBalanced(n, []string{"m"}, testTimeout)
	_, err := admin.Revoke(ctx, s.Lease())
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, m.res, testTimeout, "Run"), etcdsync.ErrSessionExpired)
}
