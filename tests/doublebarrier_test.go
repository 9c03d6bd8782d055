package tests

// DoubleBarrier: Enter waits for count parties, Leave for all of them; a
// party beyond count or coming while a round is under way is refused; a
// cancelled or failed call leaves no key; a party whose lease ends never
// holds the others; parties of etcd's recipe mix with ours.

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	recipe "go.etcd.io/etcd/client/v3/experimental/recipes"
)

// newParty returns a party of the double barrier on name for count, with
// a session of its own on cli.
func newParty(t *testing.T, cli *clientv3.Client, name string, count int, opts ...etcdsync.SessionOption) (*etcdsync.DoubleBarrier, *etcdsync.Session) {
	t.Helper()
	s := session(t, cli, opts...)
	return etcdsync.NewDoubleBarrier(s, name, count), s
}

// Enter returns once count parties have entered, and only then; Leave once
// all have left, and only then. The keys are etcd's recipe's: one
// NAME/waiters/<lease-hex> per party, NAME/ready once the round filled;
// none is left after the round, and the same values make a second round.
func TestDoubleBarrierEnterWaitsForCountLeaveForAll(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "/phase/double"
	var dbs []*etcdsync.DoubleBarrier
	var want []string
	for range 3 {
		db, s := newParty(t, cli, name, 3)
		dbs = append(dbs, db)
		want = append(want, keyOf(name+"/waiters", s))
	}
	slices.Sort(want)
	for round := range 2 {
		e0 := async(func() error { return dbs[0].Enter(ctx) })
		e1 := async(func() error { return dbs[1].Enter(ctx) })
		waitKeys(t, cli, name+"/waiters/", 2)
		notYet(t, e0, 200*time.Millisecond, fmt.Sprintf("round %d: Enter with 2 of 3 in", round))
		notYet(t, e1, 0, "Enter with 2 of 3 in")
		require.NoError(t, dbs[2].Enter(ctx), "the third party's Enter")
		require.NoError(t, resultWithin(t, e0, testTimeout, "the first party's Enter"))
		require.NoError(t, resultWithin(t, e1, testTimeout, "the second party's Enter"))
		require.Equal(t, append([]string{name + "/ready"}, want...), keys(t, cli, name+"/"))

		l0 := async(func() error { return dbs[0].Leave(ctx) })
		l2 := async(func() error { return dbs[2].Leave(ctx) })
		notYet(t, l0, 200*time.Millisecond, "Leave with one party still in")
		notYet(t, l2, 0, "Leave with one party still in")
		require.NoError(t, dbs[1].Leave(ctx))
		require.NoError(t, resultWithin(t, l0, testTimeout, "the first party's Leave"))
		require.NoError(t, resultWithin(t, l2, testTimeout, "the third party's Leave"))
		require.Empty(t, keys(t, cli, name+"/"), "round %d", round)
	}
}

// A party beyond count, or one that comes while a round is under way (its
// parties have not all left), is refused with ErrLocked and leaves no key;
// once the round's last party has left, a new round forms.
func TestDoubleBarrierRefusesPartyBeyondCount(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "full-double"
	// Three parties for two, all at once: one is refused.
	var dbs []*etcdsync.DoubleBarrier
	var errs []<-chan error
	for range 3 {
		db, _ := newParty(t, cli, name, 2)
		dbs = append(dbs, db)
		errs = append(errs, async(func() error { return db.Enter(ctx) }))
	}
	var in, out []*etcdsync.DoubleBarrier
	for i, ch := range errs {
		err := resultWithin(t, ch, testTimeout, "Enter")
		if err == nil {
			in = append(in, dbs[i])
			continue
		}
		require.ErrorIs(t, err, etcdsync.ErrLocked)
		out = append(out, dbs[i])
	}
	require.Len(t, in, 2)
	require.Len(t, out, 1)
	require.Len(t, keys(t, cli, name+"/waiters/"), 2, "the refused party's key is gone")

	l0 := async(func() error { return in[0].Leave(ctx) })
	require.NoError(t, in[1].Leave(ctx))
	require.NoError(t, resultWithin(t, l0, testTimeout, "Leave"))
	require.Empty(t, keys(t, cli, name+"/"))

	// A party that comes while the round is under way, also once its
	// newest party has left (the oldest waits in Leave), is refused.
	a, b, c := in[0], in[1], out[0]
	ea := async(func() error { return a.Enter(ctx) })
	waitKeys(t, cli, name+"/waiters/", 1)
	require.NoError(t, b.Enter(ctx))
	require.NoError(t, resultWithin(t, ea, testTimeout, "Enter"))
	require.ErrorIs(t, c.Enter(ctx), etcdsync.ErrLocked, "a party during the round")
	lb := async(func() error { return b.Leave(ctx) })
	waitCount(t, cli, name+"/waiters/", testTimeout, func(n int) bool { return n == 1 })
	err := c.Enter(ctx)
	require.ErrorIs(t, err, etcdsync.ErrLocked, "a party while the round's oldest party is in")
	require.Contains(t, err.Error(), "under way")
	require.Len(t, keys(t, cli, name+"/waiters/"), 1, "the refused party's key is gone")
	require.NoError(t, a.Leave(ctx))
	require.NoError(t, resultWithin(t, lb, testTimeout, "Leave"))
	require.Empty(t, keys(t, cli, name+"/"))

	// The next round.
	ec := async(func() error { return c.Enter(ctx) })
	require.NoError(t, a.Enter(ctx))
	require.NoError(t, resultWithin(t, ec, testTimeout, "Enter of the next round"))
	lc := async(func() error { return c.Leave(ctx) })
	require.NoError(t, a.Leave(ctx))
	require.NoError(t, resultWithin(t, lc, testTimeout, "Leave of the next round"))
	require.Empty(t, keys(t, cli, name+"/"))
}

// Misuse is an error wrapping a sentinel, never a panic, and writes
// nothing: Leave without Enter, Enter twice, a second party on one
// Session, a count below 1, a nil session, a bad name.
func TestDoubleBarrierMisuseIsAnError(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "misused-double"
	s := session(t, cli)
	db := etcdsync.NewDoubleBarrier(s, name, 1)
	require.ErrorIs(t, db.Leave(ctx), etcdsync.ErrInvalidArgument, "Leave without Enter")
	require.NoError(t, db.Enter(ctx), "one party of one")
	require.ErrorIs(t, db.Enter(ctx), etcdsync.ErrInvalidArgument, "Enter twice")
	require.ErrorIs(t, etcdsync.NewDoubleBarrier(s, name, 1).Enter(ctx), etcdsync.ErrInvalidArgument, "a second party on the session")
	require.NoError(t, db.Leave(ctx))
	require.ErrorIs(t, db.Leave(ctx), etcdsync.ErrInvalidArgument, "Leave twice")
	require.Empty(t, keys(t, cli, name+"/"))

	for _, tc := range []struct {
		db   *etcdsync.DoubleBarrier
		want error
	}{
		{etcdsync.NewDoubleBarrier(s, name, 0), etcdsync.ErrInvalidArgument},
		{etcdsync.NewDoubleBarrier(s, name, -1), etcdsync.ErrInvalidArgument},
		{etcdsync.NewDoubleBarrier(nil, name, 2), etcdsync.ErrInvalidArgument},
		{etcdsync.NewDoubleBarrier(s, "", 2), etcdsync.ErrInvalidName},
		{etcdsync.NewDoubleBarrier(s, "a\x00b", 2), etcdsync.ErrInvalidName},
	} {
		require.ErrorIs(t, tc.db.Enter(ctx), tc.want)
		require.ErrorIs(t, tc.db.Leave(ctx), tc.want)
	}
	require.Empty(t, keys(t, cli, ""), "no key left by anything above")
}

// A cancelled Enter removes its key, at any point of its create, and
// while it waits; the others wait on, and the round forms without it.
// A cancelled Leave removes the party's key: the others' Leave returns.
func TestDoubleBarrierCancelLeavesNoKey(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "cancelled-double"
	stay, _ := newParty(t, cli, name, 3)
	e := async(func() error { return stay.Enter(ctx) })
	waitKeys(t, cli, name+"/waiters/", 1)
	stayKeys := keys(t, cli, name+"/")

	db, _ := newParty(t, cli, name, 3)
	cancelsLeaveOnly(t, ctx, cli, name+"/waiters/", stayKeys[0], 16, 8, func(ctx context.Context, _ int) error {
		ectx, cancel := context.WithTimeout(ctx, 2*time.Millisecond) // ends while it waits, if not before
		defer cancel()
		return db.Enter(ectx)
	})
	wctx, cancel := context.WithCancel(ctx)
	w := async(func() error { return db.Enter(wctx) })
	waitKeys(t, cli, name+"/waiters/", 2)
	cancel()
	require.ErrorIs(t, resultWithin(t, w, testTimeout, "the cancelled Enter"), context.Canceled)
	require.Equal(t, stayKeys, keys(t, cli, name+"/"))
	notYet(t, e, 100*time.Millisecond, "Enter after the other party's cancel")

	second, _ := newParty(t, cli, name, 3)
	third, _ := newParty(t, cli, name, 3)
	e2 := async(func() error { return second.Enter(ctx) })
	waitKeys(t, cli, name+"/waiters/", 2)
	require.NoError(t, third.Enter(ctx))
	require.NoError(t, resultWithin(t, e, testTimeout, "Enter once the round filled"))
	require.NoError(t, resultWithin(t, e2, testTimeout, "Enter once the round filled"))

	// stay is the oldest: it waits for the others; second's Leave is
	// cancelled while it waits for stay, third's while stay waits for it.
	lctx, lcancel := context.WithCancel(ctx)
	l2 := async(func() error { return second.Leave(lctx) })
	ls := async(func() error { return stay.Leave(ctx) })
	notYet(t, ls, 100*time.Millisecond, "Leave while third is in")
	lcancel()
	require.ErrorIs(t, resultWithin(t, l2, testTimeout, "the cancelled Leave"), context.Canceled)
	lctx, lcancel = context.WithCancel(ctx)
	lcancel()
	require.ErrorIs(t, third.Leave(lctx), context.Canceled, "a Leave whose context has ended")
	require.NoError(t, resultWithin(t, ls, testTimeout, "Leave of the party left alone"))
	require.Empty(t, keys(t, cli, name+"/"))
}

// A party whose lease ends (revoked here; a crashed party's expires)
// never holds the others: waiting in Enter or Leave, its own call returns
// ErrSessionExpired at once; in Enter it no longer counts (a replacement
// takes its place); in a round, it counts as having left, whether it is
// the newest party (the oldest's Leave waits for it) or the oldest (the
// others' Leave waits for it), and when the round's last party went
// without a Leave, the party that sees the round empty closes it.
func TestDoubleBarrierPartyWhoseLeaseEndsHoldsNoOne(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	revoke := func(s *etcdsync.Session) {
		t.Helper()
		_, err := cli.Revoke(ctx, s.Lease())
		require.NoError(t, err)
	}
	const name = "crashed-double"
	a, as := newParty(t, cli, name, 3)
	b, _ := newParty(t, cli, name, 3)
	ea := async(func() error { return a.Enter(ctx) })
	waitKeys(t, cli, name+"/waiters/", 1)
	eb := async(func() error { return b.Enter(ctx) })
	waitKeys(t, cli, name+"/waiters/", 2)
	revoke(as)
	require.ErrorIs(t, resultWithin(t, ea, 5*time.Second, "Enter of the party whose lease ended"), etcdsync.ErrSessionExpired)
	c, _ := newParty(t, cli, name, 3)
	ec := async(func() error { return c.Enter(ctx) })
	waitKeys(t, cli, name+"/waiters/", 2)
	notYet(t, eb, 100*time.Millisecond, "Enter with 2 of 3 in (one went)")
	d, ds := newParty(t, cli, name, 3)
	require.NoError(t, d.Enter(ctx), "the replacement's Enter")
	require.NoError(t, resultWithin(t, eb, testTimeout, "Enter"))
	require.NoError(t, resultWithin(t, ec, testTimeout, "Enter"))

	// The newest party's lease ends while the others leave.
	lb := async(func() error { return b.Leave(ctx) })
	lc := async(func() error { return c.Leave(ctx) })
	notYet(t, lb, 200*time.Millisecond, "Leave while a party is in")
	notYet(t, lc, 0, "Leave while a party is in")
	revoke(ds)
	require.NoError(t, resultWithin(t, lb, testTimeout, "Leave after the last party's lease ended"))
	require.NoError(t, resultWithin(t, lc, testTimeout, "Leave after the last party's lease ended"))
	require.ErrorIs(t, d.Leave(ctx), etcdsync.ErrSessionExpired, "Leave of the party whose lease ended")
	require.Empty(t, keys(t, cli, name+"/"))

	// In a round of o (the oldest), m and n: m leaves and waits for o; o
	// waits in Leave for n. o's lease ends: o's Leave returns
	// ErrSessionExpired at once, and m waits on for n. n's lease ends
	// without a Leave: m's Leave returns, and m closes the round (deletes
	// ready) itself.
	const second = "crashed-oldest"
	o, os := newParty(t, cli, second, 3)
	m, _ := newParty(t, cli, second, 3)
	n, ns := newParty(t, cli, second, 3)
	eo := async(func() error { return o.Enter(ctx) })
	waitKeys(t, cli, second+"/waiters/", 1)
	em := async(func() error { return m.Enter(ctx) })
	waitKeys(t, cli, second+"/waiters/", 2)
	require.NoError(t, n.Enter(ctx))
	require.NoError(t, resultWithin(t, eo, testTimeout, "Enter"))
	require.NoError(t, resultWithin(t, em, testTimeout, "Enter"))
	lm := async(func() error { return m.Leave(ctx) })
	waitCount(t, cli, second+"/waiters/", testTimeout, func(k int) bool { return k == 2 })
	lo := async(func() error { return o.Leave(ctx) })
	notYet(t, lo, 100*time.Millisecond, "the oldest's Leave while n is in")
	revoke(os)
	require.ErrorIs(t, resultWithin(t, lo, 5*time.Second, "Leave of the party whose lease ended"), etcdsync.ErrSessionExpired)
	notYet(t, lm, 100*time.Millisecond, "Leave while n is in")
	revoke(ns)
	require.NoError(t, resultWithin(t, lm, testTimeout, "Leave after the other parties' leases ended"))
	require.Empty(t, keys(t, cli, second+"/"), "ready is deleted by the party that saw the round empty")
}

// A party that crashes (its session orphaned: no Leave, no revoke) holds
// the others' Leave only until its lease expires on the server.
func TestDoubleBarrierLeaveOutlastsCrashedPartyLease(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	_, cli, ctx := singleClient(t)
	const name = "expired-double"
	a, _ := newParty(t, cli, name, 2)
	b, bs := newParty(t, cli, name, 2, etcdsync.WithTTL(2*time.Second))
	ea := async(func() error { return a.Enter(ctx) })
	waitKeys(t, cli, name+"/waiters/", 1)
	require.NoError(t, b.Enter(ctx))
	require.NoError(t, resultWithin(t, ea, testTimeout, "Enter"))
	bs.Orphan() // b's process is gone
	la := async(func() error { return a.Leave(ctx) })
	notYet(t, la, time.Second, "Leave before the crashed party's lease can expire")
	require.NoError(t, resultWithin(t, la, 10*time.Second, "Leave after the crashed party's lease expired"))
	require.Empty(t, keys(t, cli, name+"/"))
}

// Parties of etcd's recipe DoubleBarrier and ours enter and leave one round
// together, whichever kind makes count and whichever is the oldest.
func TestDoubleBarrierMixesWithEtcdRecipeParties(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "interop-double"
	type party struct {
		enter, leave func() error
	}
	ours := func() party {
		db, _ := newParty(t, cli, name, 4)
		return party{func() error { return db.Enter(ctx) }, func() error { return db.Leave(ctx) }}
	}
	theirs := func() party {
		db := recipe.NewDoubleBarrier(theirSession(t, cli), name, 4)
		return party{db.Enter, db.Leave}
	}
	for _, order := range [][]func() party{
		{ours, theirs, ours, theirs},   // ours oldest, theirs makes count
		{theirs, ours, theirs, ours},   // theirs oldest, ours makes count
		{theirs, theirs, theirs, ours}, // ours alone among theirs
		{ours, ours, ours, theirs},     // theirs alone among ours
	} {
		var ps []party
		var entered []<-chan error
		for i, mk := range order {
			p := mk()
			ps = append(ps, p)
			entered = append(entered, async(p.enter))
			waitKeys(t, cli, name+"/waiters/", i+1) // this order of creates
		}
		for _, ch := range entered {
			require.NoError(t, resultWithin(t, ch, testTimeout, "Enter"))
		}
		var left []<-chan error
		for i := len(ps) - 1; i > 0; i-- {
			left = append(left, async(ps[i].leave))
		}
		notYet(t, left[0], 200*time.Millisecond, "Leave while the oldest party is in")
		require.NoError(t, ps[0].leave(), "the oldest party's Leave")
		for _, ch := range left {
			require.NoError(t, resultWithin(t, ch, testTimeout, "Leave"))
		}
		require.Empty(t, keys(t, cli, name+"/"))
	}
}

// A party waiting in Enter keeps its place when its watch stream breaks
// and the revisions it watched from have been compacted meanwhile: it reads
// again, watches again, and is let out when the round fills.
func TestDoubleBarrierEnterSurvivesCompaction(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name = "compacted-double"
	p := faults.Proxy(t, c)
	cnt := counter{created: make(chan struct{}, 16)}
	a, _ := newParty(t, etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...), name, 2)
	ea := async(func() error { return a.Enter(ctx) })
	awaitCreated(t, cnt.created, 2, testTimeout, "the party's watches (ready, its own key)")
	var last int64
	for range 2 { // past the revision the watches start from
		resp, err := admin.Put(ctx, "compaction-filler", "x")
		require.NoError(t, err)
		last = resp.Header.Revision
	}
	_, err := admin.Compact(ctx, last)
	require.NoError(t, err)
	p.DropConnections()
	awaitCreated(t, cnt.created, 4, testTimeout, "the resumed (compacted) watches, then the new ones")
	notYet(t, ea, 100*time.Millisecond, "Enter with 1 of 2 in")
	b, _ := newParty(t, admin, name, 2)
	require.NoError(t, b.Enter(ctx))
	require.NoError(t, resultWithin(t, ea, testTimeout, "Enter after the compaction"))
	la := async(func() error { return a.Leave(ctx) })
	require.NoError(t, b.Leave(ctx))
	require.NoError(t, resultWithin(t, la, testTimeout, "Leave"))
	require.Empty(t, keys(t, admin, name+"/"))
}

// Parties keep their place across a member stopped and restarted: a party
// whose client reaches only that member waits through the outage and is
// let out of Enter by the party that made count meanwhile; all leave.
func TestDoubleBarrierThroughMemberRestart(t *testing.T) {
	t.Parallel()
	c := three(t)
	ctx := ctxT(t)
	const name = "restart-double"
	// a reaches only member 0, through a proxy (cut before the stop, so
	// that the member need not wait for a's streams to end); the others
	// reach the other two members.
	cnt := counter{created: make(chan struct{}, 16)}
	only, p := faults.Proxied(t, c, cnt.dial()...)
	m := c.Member(0)
	others := etcdtest.NewClient(t, []string{c.Member(1).Endpoint(), c.Member(2).Endpoint()})
	a, _ := newParty(t, only, name, 3)
	b, _ := newParty(t, others, name, 3)
	ea := async(func() error { return a.Enter(ctx) })
	eb := async(func() error { return b.Enter(ctx) })
	waitKeys(t, others, name+"/waiters/", 2)
	// a waits (its create's reply came: it watches), so the cut finds it
	// waiting, not with its create's reply on the way.
	within(t, cnt.created, testTimeout, "a's watch created")
	p.Blackhole(true)
	p.DropConnections()
	c.Stop(m)
	d, _ := newParty(t, others, name, 3)
	require.NoError(t, d.Enter(ctx), "Enter of the party that makes count")
	require.NoError(t, resultWithin(t, eb, testTimeout, "Enter of a party on the members up"))
	require.NoError(t, c.Restart(m))
	p.Blackhole(false)
	require.NoError(t, resultWithin(t, ea, testTimeout, "Enter of the party whose member came back"))
	var left []<-chan error
	for _, p := range []*etcdsync.DoubleBarrier{a, b, d} {
		left = append(left, async(func() error { return p.Leave(ctx) }))
	}
	for _, ch := range left {
		require.NoError(t, resultWithin(t, ch, testTimeout, "Leave"))
	}
	require.Empty(t, keys(t, others, name+"/"))
}

// A party whose key goes (lease revoked, or its Enter cancelled) after the
// party that makes count has read the round but before it puts ready: the
// doc says such a party no longer counts and the others go on waiting for
// count parties. fill's transaction checks only the filler's own key and
// ready, not the parties it counted, so the filler lets a round of one out
// of Enter with count 2.
func TestDoubleBarrierFillAfterACountedPartyWent(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	const name = "a28bdb"
	first, s0 := newParty(t, admin, name, 2)
	e0 := async(func() error { return first.Enter(ctx) })
	waitKeys(t, admin, name+"/waiters/", 1)

	var sc faults.Script
	cli := c.Client(t, sc.Dial())
	s1 := session(t, cli)
	second := etcdsync.NewDoubleBarrier(s1, name, 2)
	gate, reached := make(chan struct{}), make(chan struct{})
	sc.Arm(faults.TxnMethod, faults.Pass, func(c faults.Call) error { // the join, then the fill
		close(reached)
		<-gate
		return c.Invoke()
	})
	e1 := async(func() error { return second.Enter(ctx) })
	within(t, reached, testTimeout, "the second party's put of ready")
	_, err := admin.Revoke(ctx, s0.Lease())
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, e0, testTimeout, "the first party whose lease was revoked"), etcdsync.ErrSessionExpired)
	close(gate)
	select {
	case err := <-e1:
		t.Errorf("Enter of a double barrier of 2 returned (%v) with one party in: %v", err, keys(t, admin, name+"/"))
		if err == nil {
			require.NoError(t, second.Leave(ctx))
		}
	case <-time.After(time.Second):
		third, _ := newParty(t, admin, name, 2)
		require.NoError(t, third.Enter(ctx))
		require.NoError(t, resultWithin(t, e1, testTimeout, "the second party once a third came"))
		l := async(func() error { return third.Leave(ctx) })
		require.NoError(t, second.Leave(ctx))
		require.NoError(t, resultWithin(t, l, testTimeout, "Leave"))
	}
	waitNoKeys(t, admin, name+"/")
}
