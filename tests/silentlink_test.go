package tests

// A wait keeps its bounds on a silent link: whichever watch it is opening
// when its link goes silent (its first, the move to the watch of the whole
// prefix, its own key's again after a read, the first after a failed watch),
// Lock returns by its context's end, and with no deadline by its session's
// end; and once the link is back and the session closed, no gRPC watch
// stream of the wait is left open.

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
)

// cleanupBound is how long a failed Lock may take, past its end, to remove
// its key when etcd cannot be reached (the library's CreateGrace).
const cleanupBound = time.Second

// silencingWatcher is a client's Watcher that, on the Watch call numbered
// silenceAt (from 1, counted since arm), first makes the link silent
// (Blackhole on the client's proxy) and reports it on silenced; on the call
// numbered breakAt, it hands back a channel that closes after the watch's
// first response, as a watch that fails does. It counts only the calls on
// key only, when set. ready (made anew by each arm) closes when the call
// numbered readyAt has returned (its watch created), at once when readyAt
// is 0. watched records the key of every call.
type silencingWatcher struct {
	clientv3.Watcher
	proxy           *etcdtest.Proxy
	silenced, ready chan struct{}

	mu                                 sync.Mutex
	only                               string
	calls, readyAt, silenceAt, breakAt int
	watched                            []string // the keys of every Watch call, in order
}

func (w *silencingWatcher) arm(only string, readyAt, silenceAt, breakAt int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.only, w.calls, w.readyAt, w.silenceAt, w.breakAt = only, 0, readyAt, silenceAt, breakAt
	w.ready = make(chan struct{}) // each arm has a ready and a silenced of its own
	w.silenced = make(chan struct{})
	if readyAt == 0 {
		close(w.ready)
	}
}

func (w *silencingWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	w.mu.Lock()
	w.watched = append(w.watched, key)
	counted := w.only == "" || key == w.only
	if counted {
		w.calls++
	}
	n := w.calls
	silence, broken := counted && n == w.silenceAt, counted && n == w.breakAt
	ready, readied := w.ready, counted && n == w.readyAt
	silenced := w.silenced
	w.mu.Unlock()
	if silence {
		w.proxy.Blackhole(true)
		close(silenced)
	}
	ch := w.Watcher.Watch(ctx, key, opts...)
	if readied {
		close(ready)
	}
	if !broken {
		return ch
	}
	out := make(chan clientv3.WatchResponse, 1)
	go func() {
		defer close(out)
		if wr, ok := <-ch; ok {
			out <- wr
		}
	}()
	return out
}

// calledOn waits until a Watch call on key was made.
func (w *silencingWatcher) calledOn(t *testing.T, key string) {
	for deadline := time.Now().Add(testTimeout); ; time.Sleep(10 * time.Millisecond) {
		w.mu.Lock()
		called := slices.Contains(w.watched, key)
		w.mu.Unlock()
		if called {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no Watch call on %s within %v", key, testTimeout)
		}
	}
}

// silentRig is a waiter's client through a proxy whose link a
// silencingWatcher silences, with its Watch streams counted.
type silentRig struct {
	cli   *clientv3.Client
	proxy *etcdtest.Proxy
	sw    *silencingWatcher
	ow    *openWatches
}

func newSilentRig(t *testing.T, c *etcdtest.Cluster) *silentRig {
	p := etcdtest.NewProxy(t, strings.TrimPrefix(c.Member(0).Endpoint(), "http://"))
	ow := &openWatches{}
	cli := etcdtest.NewClient(t, []string{p.Endpoint()}, ow.dial())
	sw := &silencingWatcher{Watcher: cli.Watcher, proxy: p, silenced: make(chan struct{}), ready: make(chan struct{})}
	cli.Watcher = sw
	t.Cleanup(func() { p.Blackhole(false) })
	return &silentRig{cli: cli, proxy: p, sw: sw, ow: ow}
}

// silentStep is one place where a wait opens a watch: setup queues keys
// ahead of the waiter (on the admin client) and arms the watcher; trigger,
// if set, makes the wait open the watch once it waits.
type silentStep struct {
	name    string
	ahead   int // Mutexes queued before the waiter (the first holds)
	arm     func(w *silencingWatcher, name string)
	trigger func(t *testing.T, ctx context.Context, admin *clientv3.Client, ahead []string)
}

var silentSteps = []silentStep{
	{name: "first", ahead: 1, arm: func(w *silencingWatcher, _ string) { w.arm("", 0, 1, 0) }},
	// Three ahead: the waiter watches its key and the two nearest (calls 1
	// to 3); the nearest's delete moves it to the prefix (call 4).
	{name: "toPrefix", ahead: 3, arm: func(w *silencingWatcher, _ string) { w.arm("", 3, 4, 0) },
		trigger: deleteNth(2)},
	// Five ahead: the move to the prefix (call 4), a read that lists three
	// of the five, and its own key's watch again (call 5).
	{name: "afterRead", ahead: 5, arm: func(w *silencingWatcher, _ string) { w.arm("", 3, 5, 0) },
		trigger: deleteNth(4)},
	// The first watch fails: the wait reads and watches the prefix again
	// on a new stream (the second call on the prefix).
	{name: "retry", ahead: 1, arm: func(w *silencingWatcher, name string) { w.arm(name+"/", 0, 2, 1) }},
}

// deleteNth deletes the key of the i-th Mutex ahead.
func deleteNth(i int) func(t *testing.T, ctx context.Context, admin *clientv3.Client, ahead []string) {
	return func(t *testing.T, ctx context.Context, admin *clientv3.Client, ahead []string) {
		_, err := admin.Delete(ctx, ahead[i])
		require.NoError(t, err)
	}
}

// A Lock whose link goes silent as it opens a watch returns by its
// deadline (plus the bounded removal of its key, which cannot reach etcd
// either), with the deadline's error; once the link is back and its
// session closed, no watch stream of its wait is open.
func TestLockKeepsItsDeadlineOnASilentLink(t *testing.T) {
	t.Parallel()
	c := single(t)
	for _, step := range silentSteps { // one at a time: another's writes would change the wait's path
		t.Run(step.name, func(t *testing.T) {
			err, took := lockOnSilentLink(t, c, step, "silent-deadline-"+step.name, 1500*time.Millisecond, 30*time.Second)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.Less(t, took, 1500*time.Millisecond+cleanupBound+2*time.Second, "the Lock's return after the link went silent")
		})
	}
}

// With no deadline, the same Lock returns by its session's end (the
// session's keepalives cannot get through either), with ErrSessionExpired.
func TestLockEndsWithItsSessionOnASilentLink(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c := single(t)
	for _, step := range silentSteps { // one at a time, as above
		t.Run(step.name, func(t *testing.T) {
			const ttl = 2 * time.Second
			err, took := lockOnSilentLink(t, c, step, "silent-session-"+step.name, 0, ttl)
			require.ErrorIs(t, err, etcdsync.ErrSessionExpired)
			require.Less(t, took, ttl+cleanupBound+3*time.Second, "the Lock's return after the link went silent")
		})
	}
}

// lockOnSilentLink queues step.ahead Mutexes on name, then a waiter on a
// session of TTL ttl through a proxy that goes silent as step says, its
// Lock bounded by deadline (0: none). It returns the Lock's error and how
// long after the silence it returned; then it heals the link, closes the
// waiter's session, and checks that no key and no Watch stream of a wait
// is left.
func lockOnSilentLink(t *testing.T, c *etcdtest.Cluster, step silentStep, name string, deadline, ttl time.Duration) (error, time.Duration) {
	admin := c.Client(t)
	ctx := ctxT(t)
	rig := newSilentRig(t, c)
	var ahead []string
	var ms []*etcdsync.Mutex
	qctx, qcancel := context.WithCancel(ctx)
	var queued []<-chan error
	for i := range step.ahead {
		s := session(t, admin)
		m := etcdsync.NewMutex(s, name)
		ms = append(ms, m)
		ahead = append(ahead, keyOf(name, s))
		if i == 0 {
			require.NoError(t, m.Lock(ctx))
		} else {
			queued = append(queued, async(func() error { return m.Lock(qctx) }))
		}
		waitKeys(t, admin, name+"/", i+1)
	}
	defer func() { // the queued Locks end before the next step, which their removals would disturb
		qcancel()
		for _, q := range queued {
			_ = resultWithin(t, q, testTimeout, "a queued Lock")
		}
	}()
	s := session(t, rig.cli, etcdsync.WithTTL(ttl))
	waiter := etcdsync.NewMutex(s, name)
	step.arm(rig.sw, name)
	lctx, cancel := ctx, context.CancelFunc(func() {})
	if deadline > 0 {
		lctx, cancel = context.WithTimeout(ctx, deadline)
	}
	defer cancel()
	began := time.Now()
	res := async(func() error { return waiter.Lock(lctx) })
	if step.trigger != nil {
		within(t, rig.sw.ready, testTimeout, "the wait's watches before the trigger")
		t.Logf("%s: the wait's first watches after %v", step.name, time.Since(began).Round(time.Millisecond))
		step.trigger(t, ctx, admin, ahead)
	}
	within(t, rig.sw.silenced, testTimeout, fmt.Sprintf("the link going silent at Watch call %d", rig.sw.silenceAt))
	silent := time.Now()
	t.Logf("%s: silent %v after the Lock began", step.name, silent.Sub(began).Round(time.Millisecond))
	err := resultWithin(t, res, 20*time.Second, "the Lock on a silent link")
	took := time.Since(silent)
	t.Logf("%s: Lock returned %v after the link went silent: %v", step.name, took.Round(time.Millisecond), err)
	rig.proxy.Blackhole(false)
	require.NoError(t, s.Close())
	rig.ow.settleTo(t, 0, 10*time.Second, "after the Lock on a silent link and its session's Close")
	require.NotContains(t, keys(t, admin, name+"/"), keyOf(name, s))
	for _, m := range ms {
		_ = m.Unlock(ctx)
	}
	return err, took
}

// silentWait is a blocking call of one primitive, on a name that another
// session (block, on the admin client) keeps it waiting on.
type silentWait struct {
	name        string
	sessionless bool // the wait has no session to end with (Barrier.Wait)
	// shared: the wait watches on the client's shared stream, under the
	// caller's context; a watch cancelled before the server created it can
	// keep that one stream open (docs/protocol.md, known limits), so only
	// the waits' own streams are counted.
	shared bool
	block  func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string)
	wait   func(ctx context.Context, s *etcdsync.Session, name string) error
}

var silentWaits = []silentWait{
	{name: "RLock", block: func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string) {
		require.NoError(t, etcdsync.NewRWMutex(session(t, admin), name).Lock(ctx))
	}, wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
		return etcdsync.NewRWMutex(s, name).RLock(ctx)
	}},
	{name: "Lock-behind-readers", block: func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string) {
		for range 2 {
			require.NoError(t, etcdsync.NewRWMutex(session(t, admin), name).RLock(ctx))
		}
	}, wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
		return etcdsync.NewRWMutex(s, name).Lock(ctx)
	}},
	{name: "Acquire", block: func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string) {
		require.NoError(t, etcdsync.NewSemaphore(session(t, admin), name, 3).Acquire(ctx, 2))
	}, wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
		return etcdsync.NewSemaphore(s, name, 3).Acquire(ctx, 2)
	}},
	{name: "Campaign", block: func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string) {
		require.NoError(t, etcdsync.NewElection(session(t, admin), name).Campaign(ctx, "leader"))
	}, wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
		return etcdsync.NewElection(s, name).Campaign(ctx, "candidate")
	}},
	{name: "MultiLock", block: func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string) {
		require.NoError(t, etcdsync.NewMutex(session(t, admin), name+"/b").Lock(ctx))
	}, wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
		return etcdsync.NewMultiLock(s, name+"/a", name+"/b").Lock(ctx)
	}},
	// Four names: the failed acquire withdraws four keys, on a link still
	// silent.
	{name: "MultiLock-4", block: func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string) {
		require.NoError(t, etcdsync.NewMutex(session(t, admin), name+"/b").Lock(ctx))
	}, wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
		return etcdsync.NewMultiLock(s, name+"/a", name+"/b", name+"/c", name+"/d").Lock(ctx)
	}},
	{name: "BarrierWait", sessionless: true, shared: true, block: func(t *testing.T, ctx context.Context, admin *clientv3.Client, name string) {
		require.NoError(t, etcdsync.NewBarrier(admin, name).Hold(ctx))
	}, wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
		return etcdsync.NewBarrier(s.Client(), name).Wait(ctx)
	}},
	{name: "DoubleBarrier", shared: true, block: func(*testing.T, context.Context, *clientv3.Client, string) {},
		wait: func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewDoubleBarrier(s, name, 2).Enter(ctx)
		}},
}

// Every primitive's wait keeps its deadline when the link goes silent as
// it opens its first watch (as a Mutex's does, above), and with no deadline
// ends with its session (whose keepalives cannot get through either); once
// the link is back and its session closed, no key of its session and no
// watch stream of its wait is left.
func TestWaitsKeepTheirDeadlineOnASilentLink(t *testing.T) {
	t.Parallel()
	c := single(t)
	for _, w := range silentWaits {
		t.Run(w.name, func(t *testing.T) {
			t.Parallel()
			const deadline = 1500 * time.Millisecond
			err, took := waitOnSilentLink(t, c, w, "silent-waits-"+w.name, deadline, 30*time.Second)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.Less(t, took, deadline+cleanupBound+2*time.Second)
		})
	}
}

func TestWaitsEndWithTheirSessionOnASilentLink(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c := single(t)
	for _, w := range silentWaits {
		if w.sessionless {
			continue
		}
		t.Run(w.name, func(t *testing.T) {
			t.Parallel()
			const ttl = 2 * time.Second
			err, took := waitOnSilentLink(t, c, w, "silent-waits-session-"+w.name, 0, ttl)
			require.ErrorIs(t, err, etcdsync.ErrSessionExpired)
			require.Less(t, took, ttl+cleanupBound+3*time.Second)
		})
	}
}

// waitOnSilentLink has w wait on name, on a session of TTL ttl through a
// proxy that goes silent as the wait opens its first watch, bounded by
// deadline (0: none). It returns the wait's error and how long after the
// silence it returned; then it heals the link, closes the session, and
// checks that no key of the session and no Watch stream of a wait is left.
func waitOnSilentLink(t *testing.T, c *etcdtest.Cluster, w silentWait, name string, deadline, ttl time.Duration) (error, time.Duration) {
	admin, ctx := c.Client(t), ctxT(t)
	w.block(t, ctx, admin, name)
	rig := newSilentRig(t, c)
	s := session(t, rig.cli, etcdsync.WithTTL(ttl))
	rig.sw.arm("", 0, 1, 0)
	lctx, cancel := ctx, context.CancelFunc(func() {})
	if deadline > 0 {
		lctx, cancel = context.WithTimeout(ctx, deadline)
	}
	defer cancel()
	res := async(func() error { return w.wait(lctx, s, name) })
	within(t, rig.sw.silenced, testTimeout, "the link going silent at the first Watch")
	silent := time.Now()
	healed := make(chan struct{})
	go func() { // the link comes back as the session ends (the wait's stream is then closed within its TTL)
		defer close(healed)
		select {
		case <-s.Done():
			rig.proxy.Blackhole(false)
		case <-ctx.Done():
		}
	}()
	defer func() { <-healed }()
	err := resultWithin(t, res, 20*time.Second, "the wait on a silent link")
	took := time.Since(silent)
	t.Logf("%s returned %v after the link went silent: %v", w.name, took.Round(time.Millisecond), err)
	rig.proxy.Blackhole(false)
	closed := time.Now()
	require.NoError(t, s.Close())
	<-healed
	t.Logf("Close took %v", time.Since(closed).Round(time.Millisecond))
	rig.ow.settleTo(t, 0, 10*time.Second, "after the wait on a silent link and its session's Close")
	if !w.shared {
		defer func() {
			if t.Failed() {
				rig.sw.mu.Lock()
				defer rig.sw.mu.Unlock()
				t.Logf("Watch calls on %q", rig.sw.watched)
			}
		}()
		rig.ow.settleAllTo(t, 0, 5*time.Second, "after the wait and its session's Close")
	}
	for _, k := range keys(t, admin, name+"/") {
		require.NotContains(t, k, fmt.Sprintf("%x", int64(s.Lease())), "a key of the closed session")
	}
	return err, took
}

// A Lock whose link goes silent as it opens its watch, and stays silent
// past its session's end for longer than the TTL (an outage that outlives
// the session, the usual cause of a session's end): once the link is back
// and the session closed, no Watch stream of the wait stays open on the
// client, which a process keeps for its next sessions.
func TestWaitOnALinkSilentPastItsSessionLeavesNoWatchStream(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c := single(t)
	admin, ctx := c.Client(t), ctxT(t)
	const name = "silent-outage"
	holder := heldMutex(t, ctx, admin, name)
	rig := newSilentRig(t, c)
	const ttl = 2 * time.Second
	s := session(t, rig.cli, etcdsync.WithTTL(ttl))
	rig.sw.arm("", 0, 1, 0)
	res := async(func() error { return etcdsync.NewMutex(s, name).Lock(ctx) })
	within(t, rig.sw.silenced, testTimeout, "the link going silent at the first Watch")
	require.ErrorIs(t, resultWithin(t, res, testTimeout, "the Lock"), etcdsync.ErrSessionExpired)
	time.Sleep(ttl + time.Second) // the fault's schedule: the outage goes on past the TTL after the session's end
	rig.proxy.Blackhole(false)
	require.NoError(t, s.Close())
	rig.ow.settleTo(t, 0, 10*time.Second, "after an outage longer than the session, and its Close")
	require.NoError(t, holder.Unlock(ctx))
}

// A key that a Lock on a silent link could not remove is swept by its
// session once etcd answers: the sweep reads the key, removes it, and
// watches for a late create of it. When the link goes silent again as the
// sweep opens that watch, and the session's Close ends the sweep before the
// server created its watch, no Watch stream of the sweep is left open once
// the link is back.
func TestSweepEndedOnASilentLinkLeavesNoWatchStream(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin, ctx := c.Client(t), ctxT(t)
	const name = "silent-sweep"
	holder := heldMutex(t, ctx, admin, name)
	rig := newSilentRig(t, c)
	s := session(t, rig.cli, etcdsync.WithTTL(30*time.Second))
	key := keyOf(name, s)
	rig.sw.arm("", 0, 1, 0)
	lctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	err := etcdsync.NewMutex(s, name).Lock(lctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "left for the session to remove")
	rig.sw.calledOn(t, key)  // the wait's stream's reaper, on the link still silent
	rig.sw.arm(key, 0, 1, 0) // the next watch of the key, the sweep's, silences the link again
	rig.proxy.Blackhole(false)
	within(t, rig.sw.silenced, testTimeout, "the link going silent at the sweep's watch")
	closed := async(s.Close)
	within(t, s.Done(), testTimeout, "the session's end")
	rig.proxy.Blackhole(false)
	require.NoError(t, resultWithin(t, closed, testTimeout, "the Close"))
	rig.ow.settleAllTo(t, 0, 10*time.Second, "after the sweep ended on a silent link, and its session's Close")
	require.NotContains(t, keys(t, admin, name+"/"), key)
	require.NoError(t, holder.Unlock(ctx))
}
