package tests

// Group membership: joining never waits, one member per session and name,
// a member whose session ends leaves by itself, and every view (Members, and
// each of Watch's) is exactly the direct children NAME/<hex> at its revision,
// kept by one watch that survives a slow reader, member stops and compaction.

import (
	"context"
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
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
)

// member is what a test compares of a member Entry.
type member struct {
	Key   string
	Rev   int64
	Lease clientv3.LeaseID
	Value string
}

func membersSeen(es []etcdsync.Entry) []member {
	out := []member{}
	for _, e := range es {
		out = append(out, member{e.Key, e.Rev, e.Lease, string(e.Value)})
	}
	return out
}

// membersAt reads name's direct children NAME/<hex> at rev, oldest first,
// independently of the library: what a view at rev must show.
func membersAt(t *testing.T, cli *clientv3.Client, name string, rev int64) []member {
	t.Helper()
	resp, err := cli.Get(ctxT(t), name+"/", clientv3.WithPrefix(), clientv3.WithRev(rev),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	require.NoError(t, err)
	out := []member{}
	for _, kv := range resp.Kvs {
		if isHexChild(name+"/", string(kv.Key)) {
			out = append(out, member{string(kv.Key), kv.CreateRevision, clientv3.LeaseID(kv.Lease), string(kv.Value)})
		}
	}
	return out
}

// requireExact checks that v is every member of name at v.Rev and nothing
// else, and that every entry is a held member.
func requireExact(t *testing.T, cli *clientv3.Client, name string, v etcdsync.GroupView) {
	t.Helper()
	require.Equal(t, membersAt(t, cli, name, v.Rev), membersSeen(v.Members), "view at %d", v.Rev)
	for _, e := range v.Members {
		require.True(t, e.Held)
		require.Equal(t, "member", e.Kind)
	}
}

// joined returns a Group on name of a new session of cli, joined with val.
func joined(t *testing.T, ctx context.Context, cli *clientv3.Client, name, val string, opts ...etcdsync.SessionOption) *etcdsync.Group {
	t.Helper()
	g := etcdsync.NewGroup(session(t, cli, opts...), name)
	require.NoError(t, g.Join(ctx, val))
	return g
}

// watchGroup starts a Watch of g under a context that ends in t's cleanup,
// which also drains the channel (it must close).
func watchGroup(t *testing.T, g *etcdsync.Group) <-chan etcdsync.GroupView {
	ctx, cancel := context.WithCancel(context.Background())
	views := g.Watch(ctx)
	t.Cleanup(func() {
		cancel()
		for range views {
		}
	})
	return views
}

// nextView returns the next view, at most testTimeout away.
func nextView(t *testing.T, views <-chan etcdsync.GroupView) etcdsync.GroupView {
	t.Helper()
	select {
	case v, ok := <-views:
		require.True(t, ok, "the view channel closed")
		return v
	case <-time.After(testTimeout):
		t.Fatal("no view within the test's timeout")
		return etcdsync.GroupView{}
	}
}

// viewUntil reads views, each exact at its Rev and later than the one
// before, until one satisfies done, and returns it.
func viewUntil(t *testing.T, cli *clientv3.Client, name string, views <-chan etcdsync.GroupView, done func(etcdsync.GroupView) bool) etcdsync.GroupView {
	t.Helper()
	var last int64
	for {
		v := nextView(t, views)
		require.Greater(t, v.Rev, last, "views in revision order")
		last = v.Rev
		requireExact(t, cli, name, v)
		if done(v) {
			return v
		}
	}
}

func memberValues(v etcdsync.GroupView) []string {
	out := []string{}
	for _, e := range v.Members {
		out = append(out, string(e.Value))
	}
	return out
}

// Members lists every member, in join order, at the revision it returns;
// keys of nested names (a group on NAME/x, a lock there) and non-ID
// children are not members.
func TestGroupMembersInJoinOrderAtOneRevision(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	const name = "pool"
	a := joined(t, ctx, cli, name, "a")
	b := joined(t, ctx, cli, name, "b")
	joined(t, ctx, cli, name+"/x", "nested")
	heldMutex(t, ctx, cli, name+"/y")
	_, err := cli.Put(ctx, name+"/zz", "not an ID")
	require.NoError(t, err)
	c := joined(t, ctx, cli, name, "c")

	es, rev, err := a.Members(ctx)
	require.NoError(t, err)
	requireExact(t, cli, name, etcdsync.GroupView{Rev: rev, Members: es})
	require.Equal(t, []string{"a", "b", "c"}, memberValues(etcdsync.GroupView{Members: es}))
	for i, g := range []*etcdsync.Group{a, b, c} {
		require.Equal(t, g.Key(), es[i].Key)
		require.Equal(t, g.Rev(), es[i].Rev)
		require.NoError(t, g.Err())
	}
	other, rev2, err := etcdsync.GroupMembers(ctx, cli, name) // no Session
	require.NoError(t, err)
	require.GreaterOrEqual(t, rev2, rev)
	require.Equal(t, es, other)

	empty, _, err := etcdsync.GroupMembers(ctx, cli, "nobody")
	require.NoError(t, err)
	require.Empty(t, empty)
}

// Join is one RPC at any group size and never waits; Join on a member sets
// its value in place (one RPC); Leave is one RPC, a second Leave none.
func TestGroupJoinAndLeaveCostOneRPC(t *testing.T) {
	t.Parallel()
	c, cli, ctx := kitSingleClient(t)
	const name = "costly"
	for range 3 {
		joined(t, ctx, cli, name, "other")
	}
	var n counter
	g := etcdsync.NewGroup(session(t, kitClient(t, c, n.dial()...)), name)
	n.take()
	require.NoError(t, g.Join(ctx, "v1"))
	rpcs, methods := n.take()
	require.Equal(t, int64(1), rpcs, "Join: %v", methods)
	rev := g.Rev()

	require.NoError(t, g.Join(ctx, "v2"))
	rpcs, methods = n.take()
	require.Equal(t, int64(1), rpcs, "Join on a member: %v", methods)
	require.Equal(t, rev, g.Rev(), "a new value keeps the place")
	es, _, err := g.Members(ctx)
	require.NoError(t, err)
	require.Len(t, es, 4)
	require.Equal(t, "v2", string(es[3].Value))

	n.take()
	require.NoError(t, g.Leave(ctx))
	rpcs, methods = n.take()
	require.Equal(t, int64(1), rpcs, "Leave: %v", methods)
	require.NoError(t, g.Leave(ctx), "Leave when not a member")
	rpcs, _ = n.take()
	require.Zero(t, rpcs)
}

// Leave deletes the member's key and ends the membership (Done, Err); a new
// Join comes last in join order.
func TestGroupLeaveEndsTheMembership(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	const name = "leavers"
	g := joined(t, ctx, cli, name, "g")
	done := g.Done()
	old := g.Rev()
	h := joined(t, ctx, cli, name, "h")
	require.NoError(t, g.Leave(ctx))
	within(t, done, time.Second, "Done after Leave")
	require.ErrorIs(t, g.Err(), etcdsync.ErrLockReleased)
	require.Equal(t, "", g.Key())
	require.Zero(t, g.Rev())
	require.Equal(t, []string{h.Key()}, keys(t, cli, name+"/"))

	require.NoError(t, g.Join(ctx, "g again"))
	require.Greater(t, g.Rev(), old)
	es, _, err := g.Members(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"h", "g again"}, memberValues(etcdsync.GroupView{Members: es}))
}

// One member per session and name: a second Group value of the session
// gets ErrLocked at once while the first is a member, and writes nothing.
func TestGroupOneMemberPerSession(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	const name = "once"
	s := session(t, cli)
	a, b := etcdsync.NewGroup(s, name), etcdsync.NewGroup(s, name)
	require.NoError(t, a.Join(ctx, "a"))
	errc := async(func() error { return b.Join(ctx, "b") })
	require.ErrorIs(t, resultWithin(t, errc, time.Second, "the second value's Join"), etcdsync.ErrLocked)
	es, _, err := a.Members(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, memberValues(etcdsync.GroupView{Members: es}))
	require.ErrorIs(t, b.Err(), etcdsync.ErrNotHeld)

	require.NoError(t, a.Leave(ctx))
	require.NoError(t, b.Join(ctx, "b"))
	es, _, err = b.Members(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"b"}, memberValues(etcdsync.GroupView{Members: es}))
}

// A process restarted with WithLease resumes its membership in its old
// place, with the value its new Join sets.
func TestGroupJoinResumesAfterRestart(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	const name = "restart"
	s1 := session(t, cli)
	g1 := etcdsync.NewGroup(s1, name)
	require.NoError(t, g1.Join(ctx, "before"))
	joined(t, ctx, cli, name, "later")
	s1.Orphan()
	g2 := etcdsync.NewGroup(session(t, cli, etcdsync.WithLease(s1.Lease())), name)
	require.NoError(t, g2.Join(ctx, "after"))
	require.Equal(t, keyOf(name, s1), g2.Key())
	es, _, err := g2.Members(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"after", "later"}, memberValues(etcdsync.GroupView{Members: es}))
	require.Equal(t, es[0].Rev, g2.Rev(), "its old place")
}

// Bad input is an error wrapping a sentinel from every call (Watch's
// channel closes at once), and nothing is written.
func TestGroupBadInput(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	for _, tc := range []struct {
		g    *etcdsync.Group
		name string
		want error
	}{
		{etcdsync.NewGroup(s, ""), "", etcdsync.ErrInvalidName},
		{etcdsync.NewGroup(s, "a\x00b"), "a\x00b", etcdsync.ErrInvalidName},
		{etcdsync.NewGroup(nil, "ok"), "ok", etcdsync.ErrInvalidArgument},
	} {
		require.ErrorIs(t, tc.g.Join(ctx, "v"), tc.want)
		require.ErrorIs(t, tc.g.Leave(ctx), tc.want)
		_, _, err := tc.g.Members(ctx)
		require.ErrorIs(t, err, tc.want)
		_, ok := <-tc.g.Watch(ctx)
		require.False(t, ok, "Watch's channel closes at once")
		if tc.want == etcdsync.ErrInvalidName {
			_, _, err = etcdsync.GroupMembers(ctx, cli, tc.name)
			require.ErrorIs(t, err, tc.want)
			_, err = etcdsync.WatchGroup(ctx, cli, tc.name)
			require.ErrorIs(t, err, tc.want)
		}
	}
	_, _, err := etcdsync.GroupMembers(ctx, nil, "ok")
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	_, err = etcdsync.WatchGroup(ctx, nil, "ok")
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	require.Empty(t, keys(t, cli, ""))
}

// A member whose session ends leaves by itself: closed, or its lease
// revoked by someone else. The views drop it, its Done closes and Err says
// why.
func TestGroupMemberLeavesWhenItsSessionEnds(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	const name = "ends"
	a := joined(t, ctx, cli, name, "a")
	bs := session(t, cli)
	b := etcdsync.NewGroup(bs, name)
	require.NoError(t, b.Join(ctx, "b"))
	cs := session(t, cli)
	c := etcdsync.NewGroup(cs, name)
	require.NoError(t, c.Join(ctx, "c"))
	bDone, cDone := b.Done(), c.Done()
	views := watchGroup(t, a)
	viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool { return len(v.Members) == 3 })

	require.NoError(t, bs.Close())
	v := viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool { return len(v.Members) == 2 })
	require.Equal(t, []string{"a", "c"}, memberValues(v))
	within(t, bDone, time.Second, "the closed member's Done")
	require.ErrorIs(t, b.Err(), etcdsync.ErrSessionClosed)

	_, err := cli.Revoke(ctx, cs.Lease())
	require.NoError(t, err)
	v = viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool { return len(v.Members) == 1 })
	require.Equal(t, []string{"a"}, memberValues(v))
	require.False(t, v.Resynced)
	within(t, cDone, 5*time.Second, "the revoked member's Done")
	require.Error(t, c.Err())
}

// A member whose process stops keeping its session alive leaves when its
// lease expires.
func TestGroupMemberLeavesWhenItsLeaseExpires(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	_, cli, ctx := kitSingleClient(t)
	const name = "expires"
	a := joined(t, ctx, cli, name, "a")
	bs := session(t, cli, etcdsync.WithTTL(time.Second))
	require.NoError(t, etcdsync.NewGroup(bs, name).Join(ctx, "b"))
	views := watchGroup(t, a)
	viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool { return len(v.Members) == 2 })
	bs.Orphan() // no more keepalives, no revoke
	v := viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool { return len(v.Members) == 1 })
	require.Equal(t, []string{"a"}, memberValues(v))
}

// Each view is exactly the members at its Rev (a linearizable read at that
// revision says so), in revision order, through joins, new values, leaves,
// several changes at one revision, and writes under nested names (which
// change nothing).
func TestGroupWatchViewsAreExactAtTheirRev(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	const name = "exact"
	a := joined(t, ctx, cli, name, "a")
	views := watchGroup(t, a)
	first := nextView(t, views)
	requireExact(t, cli, name, first)
	require.False(t, first.Resynced)
	require.Equal(t, []string{"a"}, memberValues(first))

	b := joined(t, ctx, cli, name, "b")
	require.NoError(t, a.Join(ctx, "a2"))
	nested := joined(t, ctx, cli, name+"/x", "nested")
	_, err := cli.Txn(ctx).Then(
		clientv3.OpPut(name+"/1f", "raw one"), clientv3.OpPut(name+"/2f", "raw two"), clientv3.OpPut(name+"/x/3f", "nested")).Commit()
	require.NoError(t, err)
	require.NoError(t, b.Leave(ctx))
	_, err = cli.Txn(ctx).Then(clientv3.OpDelete(name+"/1f"), clientv3.OpPut(name+"/2f", "raw two, again")).Commit()
	require.NoError(t, err)
	require.NoError(t, nested.Leave(ctx))
	last, err := cli.Put(ctx, name+"/x/4f", "nested, last")
	require.NoError(t, err)

	v := viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool {
		return len(v.Members) == 2 && string(v.Members[1].Value) == "raw two, again"
	})
	require.Equal(t, []string{"a2", "raw two, again"}, memberValues(v))
	require.Less(t, v.Rev, last.Header.Revision, "the view's Rev is its last change's")
	select {
	case v := <-views:
		t.Fatalf("a view after the last change: %+v", v)
	case <-time.After(200 * time.Millisecond): // a stray view would show by now
	}
}

// A reader that does not read holds nothing back: the watch goes on, and
// the reader gets the latest view, not one per change.
func TestGroupWatchSlowReaderGetsTheLatestView(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	const name = "slowreader"
	g := joined(t, ctx, cli, name, "0")
	views := watchGroup(t, g)
	requireExact(t, cli, name, nextView(t, views))
	const changes = 100
	for i := 1; i <= changes; i++ {
		require.NoError(t, g.Join(ctx, string(rune('0'+i%10))+strings.Repeat("x", i)))
	}
	n := 0
	v := viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool {
		n++
		return len(v.Members[0].Value) == 1+changes
	})
	require.Less(t, n, changes/2, "views delivered for %d changes to a reader that did not read", changes)
	require.False(t, v.Resynced)
}

// A watch compacted past (its history gone before it could resume) reads
// the members again, once, and says so; views stay exact.
func TestGroupWatchResyncsAfterCompaction(t *testing.T) {
	t.Parallel()
	c, cli, ctx := kitSingleClient(t)
	const name = "compacted"
	a := joined(t, ctx, cli, name, "a")
	gate := faults.NewGatedClient()
	gate.Armed.Store(true) // the watch's create is held until the compaction
	var n counter
	wcli := kitClient(t, c, append(n.dial(), gate.Dial())...)
	wctx, cancel := context.WithCancel(ctx)
	views, err := etcdsync.WatchGroup(wctx, wcli, name)
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		for range views {
		}
	})
	first := nextView(t, views)
	requireExact(t, cli, name, first)
	require.False(t, first.Resynced)
	within(t, gate.Held, testTimeout, "the watch's create held")

	b := joined(t, ctx, cli, name, "b")
	joined(t, ctx, cli, name, "c")
	require.NoError(t, b.Leave(ctx))
	resp, err := cli.Put(ctx, "compacted-filler", "x")
	require.NoError(t, err)
	_, err = cli.Compact(ctx, resp.Header.Revision)
	require.NoError(t, err)
	reads, _ := n.take()
	close(gate.Open)

	v := nextView(t, views)
	require.True(t, v.Resynced, "a view after the compaction says so")
	requireExact(t, cli, name, v)
	require.Equal(t, []string{"a", "c"}, memberValues(v))
	rpcs, methods := n.take()
	require.Equal(t, int64(1), rpcs, "one read to resync: %v", methods)
	require.Equal(t, int64(1), reads, "one read to start")

	// It watches on from there, no longer resynced.
	require.NoError(t, a.Join(ctx, "a2"))
	v = viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool { return string(v.Members[0].Value) == "a2" })
	require.False(t, v.Resynced)
}

// The channel closes when ctx ends, and when the client closes; the watch
// needs no lease, so it outlives the watcher's session.
func TestGroupWatchEndsWithItsContextOrClient(t *testing.T) {
	t.Parallel()
	c, cli, ctx := kitSingleClient(t)
	const name = "ending"
	s := session(t, cli)
	wctx, cancel := context.WithCancel(ctx)
	views := etcdsync.NewGroup(s, name).Watch(wctx)
	require.Empty(t, nextView(t, views).Members)
	require.NoError(t, s.Close())
	joined(t, ctx, cli, name, "after the watcher's session")
	require.Len(t, nextView(t, views).Members, 1)
	cancel()
	ended := make(chan struct{})
	go func() {
		for range views {
		}
		close(ended)
	}()
	within(t, ended, time.Second, "the channel closes when ctx ends")

	own := etcdtest.NewClient(t, c.Endpoints())
	views, err := etcdsync.WatchGroup(context.Background(), own, name)
	require.NoError(t, err)
	require.Len(t, nextView(t, views).Members, 1)
	require.NoError(t, own.Close())
	ended = make(chan struct{})
	go func() {
		for range views {
		}
		close(ended)
	}()
	within(t, ended, 5*time.Second, "the channel closes when the client closes")
}

// A watch through a member that goes away resumes on another member where
// it stopped: no view is resynced, every view is exact, and the changes
// made meanwhile show.
func TestGroupWatchResumesThroughAMemberStop(t *testing.T) {
	t.Parallel()
	c := three(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const name = "stops"
	stopped := c.Follower()
	require.NotNil(t, stopped)
	var r faults.Router
	viaStopped := etcdtest.Conn(t, stopped.Endpoint())
	r.Route(viaStopped, nil)
	wcli := etcdtest.NewClient(t, c.Endpoints(), r.Dial()...)
	a := joined(t, ctx, cli, name, "a")
	wctx, cancel := context.WithCancel(ctx)
	views, err := etcdsync.WatchGroup(wctx, wcli, name)
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		for range views {
		}
	})
	requireExact(t, cli, name, nextView(t, views))
	b := joined(t, ctx, cli, name, "b")
	viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool { return len(v.Members) == 2 })

	// The member goes: its connections drop (as when it is killed), then it
	// stops (gracefully, or its open streams would hold it up for seconds).
	// The watch goes to the leader next.
	r.Route(etcdtest.Conn(t, c.Leader().Endpoint()), nil)
	viaStopped.Close()
	c.Stop(stopped)
	joined(t, ctx, cli, name, "c")
	require.NoError(t, a.Join(ctx, "a2"))
	require.NoError(t, b.Leave(ctx))
	var resynced bool
	v := viewUntil(t, cli, name, views, func(v etcdsync.GroupView) bool {
		resynced = resynced || v.Resynced
		return len(v.Members) == 2 && string(v.Members[0].Value) == "a2"
	})
	require.Equal(t, []string{"a2", "c"}, memberValues(v))
	require.False(t, resynced, "a stopped member is no reason to read again")
}

// Members created at one revision (one transaction of an admin, of etcd's
// clients) tie on create revision. A view from the watch and a read at the
// same revision must list them in the same order: observers that take
// "the oldest member" (a coordinator) from Watch and from Members must
// agree. The watch inserts each event before the members of its revision
// (slices.BinarySearchFunc finds the first of equal revisions), so the
// watch's order is the reverse of the transaction's; etcd's read sorts them
// by key.
func TestGroupViewOrderOfSameRevisionJoinsMatchesRead(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "a28bgo"
	a := joined(t, ctx, cli, name, "a")
	views := watchGroup(t, a)
	requireExact(t, cli, name, nextView(t, views))
	lease, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	resp, err := cli.Txn(ctx).Then(
		clientv3.OpPut(name+"/1f", "one", clientv3.WithLease(lease.ID)),
		clientv3.OpPut(name+"/2f", "two", clientv3.WithLease(lease.ID)),
		clientv3.OpPut(name+"/3f", "three", clientv3.WithLease(lease.ID))).Commit()
	require.NoError(t, err)
	v := nextView(t, views)
	require.Equal(t, resp.Header.Revision, v.Rev)
	members, rev, err := a.Members(ctx)
	require.NoError(t, err)
	require.Equal(t, rev, v.Rev)
	require.Equal(t, membersSeen(members), membersSeen(v.Members), "the watch's view and the read at one revision")
	_, err = cli.Revoke(ctx, lease.ID)
	require.NoError(t, err)
}

// Views under churn: members join, leave, change values, lose their lease,
// and an admin deletes two members in one transaction, while a reader
// takes every view: each is exactly the members at its Rev, in revision
// order. Joins and Leaves racing on one Group value leave it consistent:
// a member with its key (and last value), or no key.
func TestGroupViewsExactUnderChurnAndJoinLeaveRaces(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "a28bgc"
	watcher := etcdsync.NewGroup(session(t, cli), name)
	views := watchGroup(t, watcher)
	requireExact(t, cli, name, nextView(t, views))
	const workers = 5
	rounds := 12
	if testing.Short() {
		rounds = 6
	}
	var gs []*etcdsync.Group
	var ss []*etcdsync.Session
	for range workers {
		s := session(t, cli)
		ss = append(ss, s)
		gs = append(gs, etcdsync.NewGroup(s, name))
	}
	churned := make(chan struct{})
	go func() {
		defer close(churned)
		var wg sync.WaitGroup
		for w, g := range gs {
			wg.Add(2)
			go func() {
				defer wg.Done()
				for i := range rounds {
					_ = g.Join(ctx, fmt.Sprintf("w%d-%d", w, i))
				}
			}()
			go func() {
				defer wg.Done()
				for range rounds / 2 {
					_ = g.Leave(ctx)
				}
			}()
		}
		wg.Wait()
		_, _ = cli.Txn(ctx).Then(clientv3.OpDelete(keyOf(name, ss[0])), clientv3.OpDelete(keyOf(name, ss[1]))).Commit()
		_, _ = cli.Revoke(ctx, ss[2].Lease())
	}()
	var last int64
	for done := false; !done; {
		select {
		case <-churned:
			done = true
		case v := <-views:
			require.Greater(t, v.Rev, last)
			last = v.Rev
			requireExact(t, cli, name, v)
		}
	}
	members, _, err := watcher.Members(ctx)
	require.NoError(t, err)
	byKey := map[string]string{}
	for _, m := range members {
		byKey[m.Key] = string(m.Value)
	}
	for w, g := range gs {
		if w < 3 {
			within(t, g.Done(), testTimeout, "Done of a deleted or revoked member")
		}
		val, in := byKey[keyOf(name, ss[w])]
		if g.Err() == nil {
			require.True(t, in, "worker %d: a member without its key", w)
			require.Equal(t, fmt.Sprintf("w%d-%d", w, rounds-1), val, "worker %d's value", w)
		} else {
			require.False(t, in, "worker %d: not a member (%v), yet its key is there", w, g.Err())
		}
	}
}

// Group.Members through a follower cut off from its peers (behind a Join)
// never answers without the member that joined: its read is linearizable,
// so it waits for the member to confirm (here: past a short deadline).
func TestGroupMembersNotAnsweredStaleByLaggingFollower(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	fi := slices.Index(c.Members(), f)
	viaF := etcdsync.NewGroup(session(t, faults.RoutedClient(t, c, fi, fi), etcdsync.WithTTL(10*time.Second)), "g28c")
	require.NoError(t, c.CutPeers(f))
	defer func() { require.NoError(t, c.HealPeers(f)) }()
	joiner := etcdsync.NewGroup(session(t, etcdtest.NewClient(t, []string{u.Endpoint()})), "g28c")
	require.NoError(t, joiner.Join(ctx, "x"))
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond) // below the election timeout
	defer cancel()
	ms, _, err := viaF.Members(short)
	if err == nil {
		require.True(t, slices.ContainsFunc(ms, func(e etcdsync.Entry) bool { return e.Key == joiner.Key() }), "Members through a lagging follower misses a member that joined: %v", ms)
	}
}
