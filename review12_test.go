package etcdsync_test

// Review 12: attacks on 9a71dca (RWMutex and Semaphore on the shared
// machinery: weighted rules, key directories, shared read holds).

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// r12Result waits at most d for a result on ch.
func r12Result(t *testing.T, ch <-chan error, d time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(d):
		t.Fatalf("%s: no result within %v", what, d)
		return nil
	}
}

// r12Go runs f in a goroutine and returns its result's channel.
func r12Go(f func() error) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	return ch
}

// r12NotYet fails if ch yields within d.
func r12NotYet(t *testing.T, ch <-chan error, d time.Duration, what string) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("%s: returned (%v), must still wait", what, err)
	case <-time.After(d):
	}
}

// r12Proxied returns a client of c's first member through a proxy.
func r12Proxied(t *testing.T, c *etcdtest.Cluster) (*clientv3.Client, *etcdtest.Proxy) {
	t.Helper()
	u, err := url.Parse(c.Members()[0].Endpoint())
	require.NoError(t, err)
	p := etcdtest.NewProxy(t, u.Host)
	return etcdtest.NewClient(t, []string{p.Endpoint()}), p
}

// A restarted process (WithLease) whose previous incarnation held a read:
// TryRLock must resume that key (its create revision is the fencing token)
// as RLock does, not overwrite it and record the put's revision; else the
// RUnlock's fenced delete fails and the read key stays, blocking every
// writer for as long as the session lives.
func TestR12TryRLockResumedReadKey(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	rw1 := etcdsync.NewRWMutex(s1, "r12tryres")
	require.NoError(t, rw1.RLock(ctx))
	rev := rw1.Rev()
	s1.Orphan()

	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	rw2 := etcdsync.NewRWMutex(s2, "r12tryres")
	require.NoError(t, rw2.TryRLock(ctx))
	if rw2.Rev() != rev {
		t.Errorf("TryRLock on the resumed read key: fencing token %d, the key's create revision is %d", rw2.Rev(), rev)
	}
	if _, err := rw2.Do(ctx, clientv3.OpGet("r12tryres-x")); err != nil {
		t.Errorf("Do under the resumed read hold: %v", err)
	}
	if err := rw2.RUnlock(ctx); err != nil {
		t.Errorf("RUnlock: %v", err)
	}
	require.Empty(t, keys(t, cli, "r12tryres/"), "the read key outlives RUnlock (writers wait until the session ends)")
}

// A restarted process (WithLease) whose previous incarnation held 1 of 3
// permits asks for 3: it must not hold 3 while its key says 1 (the others
// then grant themselves 2 more: 5 of 3 permits held).
func TestR12SemaphoreResumeMorePermits(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	require.NoError(t, etcdsync.NewSemaphore(s1, "r12semres", 3).Acquire(ctx, 1))
	s1.Orphan()

	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	sm2 := etcdsync.NewSemaphore(s2, "r12semres", 3)
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := sm2.Acquire(actx, 3); err != nil {
		t.Logf("Acquire(3) on the resumed 1-permit key: %v (refusing is fine)", err)
		return
	}
	other := etcdsync.NewSemaphore(session(t, cli), "r12semres", 3)
	err = other.TryAcquire(ctx, 2)
	if err == nil {
		_ = other.Release(ctx)
	}
	require.ErrorIs(t, err, etcdsync.ErrLocked, "3 of 3 permits held by the resumed hold, and 2 more granted")
	require.NoError(t, sm2.Release(ctx))
}

// Weights summed in int64: with a capacity near MaxInt64 the sum of the
// keys ahead overflows and a waiter holds with a full hold ahead of it.
func TestR12SemaphoreWeightOverflow(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const capacity = math.MaxInt64
	const name = "r12overflow"
	a := etcdsync.NewSemaphore(session(t, cli), name, capacity)
	require.NoError(t, a.Acquire(ctx, capacity))
	b := etcdsync.NewSemaphore(session(t, cli), name, capacity)
	bgot := r12Go(func() error { return b.Acquire(ctx, capacity) })
	waitKeys(t, cli, name+"/", 2)
	d := etcdsync.NewSemaphore(session(t, cli), name, capacity)
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	dgot := r12Go(func() error { return d.Acquire(dctx, capacity) })
	waitKeys(t, cli, name+"/", 3)
	select {
	case err := <-dgot:
		if err == nil {
			t.Errorf("a third full hold (%s) while the first (%s) holds", d.Key(), a.Key())
			_ = d.Release(ctx)
		}
	case <-time.After(time.Second):
	}
	cancel()
	require.NoError(t, a.Release(ctx))
	require.NoError(t, r12Result(t, bgot, testTimeout, "second full hold"))
	require.NoError(t, b.Release(ctx))
}

// A value that joins the session's read hold trusts it without an RPC:
// when that key was deleted (by an admin, say) and a writer now holds, a
// new RLock must not return as if it held a read beside the writer.
func TestR12JoinOfALostReadHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t))
	a, b := etcdsync.NewRWMutex(s, "r12join"), etcdsync.NewRWMutex(s, "r12join")
	require.NoError(t, a.RLock(ctx))
	_, err := admin.Delete(ctx, a.Key())
	require.NoError(t, err)
	w := etcdsync.NewRWMutex(session(t, admin), "r12join")
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	require.NoError(t, w.Lock(wctx), "the writer, once the read key is gone")
	rctx, rcancel := context.WithTimeout(ctx, time.Second)
	defer rcancel()
	err = b.RLock(rctx)
	if err == nil {
		t.Errorf("RLock returned nil (joined %s at %d, deleted) while writer %s holds", b.Key(), b.Rev(), w.Key())
	}
	require.NoError(t, w.Unlock(ctx))
}

// A writer's release wakes exactly the readers that may now hold (design,
// "Herd-free in the queue length"): the readers behind the next writer get
// no event from it. (They used to watch the first writer too, the "one
// more" key, so each writer's release reached every reader behind the next
// one; readers now watch only their nearest writer.)
func TestR12ReaderHerdBehindSecondWriter(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const name = "r12herd"
	w1 := etcdsync.NewRWMutex(session(t, admin), name)
	require.NoError(t, w1.Lock(ctx))
	w2 := etcdsync.NewRWMutex(session(t, admin), name)
	w2got := r12Go(func() error { return w2.Lock(ctx) })
	waitKeys(t, admin, name+"/", 2)
	cnt := counter{created: make(chan struct{}, 256)}
	cli := c.Client(t, cnt.dial()...)
	const k = 12
	got := make(chan *etcdsync.RWMutex, k)
	for i := 0; i < k; i++ {
		rw := etcdsync.NewRWMutex(session(t, cli), name)
		go func() {
			if err := rw.RLock(ctx); err != nil {
				t.Errorf("RLock: %v", err)
				return
			}
			got <- rw
		}()
		waitKeys(t, admin, name+"/", 3+i)
	}
	for range 2 * k { // own key, W2
		within(t, cnt.created, testTimeout, "reader's watch created")
	}
	require.NoError(t, w1.Unlock(ctx))
	require.NoError(t, r12Result(t, w2got, testTimeout, "second writer"))
	require.NoError(t, w2.Unlock(ctx))
	for range k {
		select {
		case rw := <-got:
			defer rw.RUnlock(ctx)
		case <-time.After(testTimeout):
			t.Fatal("readers did not hold")
		}
	}
	ev := cnt.events.Load()
	t.Logf("events delivered to %d readers behind the second writer over two writer releases: %d", k, ev)
	require.LessOrEqual(t, ev, int64(k+2), "the first writer's release reached the readers behind the second")
}

// TryRLock with no writer anywhere returns ErrLocked while the session's
// own read acquire or last RUnlock is in flight, as documented (it sends
// nothing then), and succeeds once that call has returned.
func TestR12TryRLockNoWriterInFlight(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	cli, p := r12Proxied(t, c)
	s := session(t, cli)
	a, b := etcdsync.NewRWMutex(s, "r12tryfl"), etcdsync.NewRWMutex(s, "r12tryfl")

	t.Run("acquire", func(t *testing.T) {
		p.SetLatency(time.Second)
		agot := r12Go(func() error { return a.RLock(ctx) })
		waitKeys(t, admin, "r12tryfl/read/", 1) // applied; its reply is on the way
		err := b.TryRLock(ctx)
		require.NoError(t, r12Result(t, agot, testTimeout, "RLock"))
		p.SetLatency(0)
		require.ErrorIs(t, err, etcdsync.ErrLocked, "TryRLock while the session's RLock is in flight")
		require.NoError(t, b.TryRLock(ctx), "TryRLock once it has returned")
		require.NoError(t, b.RUnlock(ctx))
	})
	t.Run("release", func(t *testing.T) {
		p.SetLatency(time.Second)
		ugot := r12Go(func() error { return a.RUnlock(ctx) })
		waitCount(t, admin, "r12tryfl/", testTimeout, func(n int) bool { return n == 0 })
		err := b.TryRLock(ctx)
		require.NoError(t, r12Result(t, ugot, testTimeout, "RUnlock"))
		p.SetLatency(0)
		require.ErrorIs(t, err, etcdsync.ErrLocked, "TryRLock while the session's last RUnlock is in flight")
		require.NoError(t, b.TryRLock(ctx), "TryRLock once it has returned")
		require.NoError(t, b.RUnlock(ctx))
	})
	p.SetLatency(0)
}

// An RUnlock whose reply is lost (its deadline ends after the server
// applied the delete) keeps the hold, as documented, and lets the session's
// other values join it again. The key is gone and a writer of another
// session holds, yet a new RLock of the session returns at once, without an
// RPC, as if it held a read: a reader and a writer hold together, and the
// reader's call said nothing was wrong.
func TestR12JoinAfterFailedRUnlock(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	cli, p := r12Proxied(t, c)
	defer p.SetLatency(0)
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	a, b := etcdsync.NewRWMutex(s, "r12rejoin"), etcdsync.NewRWMutex(s, "r12rejoin")
	require.NoError(t, a.RLock(ctx))
	w := etcdsync.NewRWMutex(session(t, admin), "r12rejoin")
	wgot := r12Go(func() error { return w.Lock(ctx) })
	waitKeys(t, admin, "r12rejoin/", 2)

	p.SetLatency(time.Second) // replies only: the delete is applied
	uctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := a.RUnlock(uctx)
	cancel()
	require.Error(t, err, "RUnlock whose reply came after its deadline")
	require.NoError(t, r12Result(t, wgot, testTimeout, "writer after the read key's delete"))
	p.SetLatency(0)

	rctx, rcancel := context.WithTimeout(ctx, time.Second)
	defer rcancel()
	if err := b.RLock(rctx); err == nil {
		t.Errorf("RLock returned nil (joined %s, deleted) while writer %s holds", b.Key(), w.Key())
	}
	require.NoError(t, w.Unlock(ctx))
}

// r12Part is one participant of a model-checked queue.
type r12Part struct {
	i      int
	w      int64 // permits; for an RWMutex, 0 reader, 1 writer
	s      *etcdsync.Session
	key    string
	take   func(context.Context) error
	give   func(context.Context) error
	got    <-chan error
	held   bool
	gone   bool // its key was deleted by someone else, or its session closed
	result bool // got has yielded
}

// r12Model runs a queue of participants on name through random releases,
// lease revocations and one-revision deletes of several keys, and checks
// after each step that exactly the participants the rule allows hold: for a
// Semaphore (rw false) the longest prefix of the queue whose permits fit
// the capacity, for an RWMutex (rw true) the first writer alone or the
// readers before the first writer.
func r12Model(t *testing.T, c *etcdtest.Cluster, name string, rw bool, capacity int64, weights []int64, seed int64) {
	ctx := ctxT(t)
	admin := c.Client(t)
	var parts []*r12Part
	for i, w := range weights {
		s := session(t, c.Client(t))
		p := &r12Part{i: i, w: w, s: s}
		switch {
		case !rw:
			sm := etcdsync.NewSemaphore(s, name, capacity)
			p.key = fmt.Sprintf("%s/%x", name, int64(s.Lease()))
			p.take = func(ctx context.Context) error { return sm.Acquire(ctx, w) }
			p.give = sm.Release
		case w == 0:
			m := etcdsync.NewRWMutex(s, name)
			p.key = fmt.Sprintf("%s/read/%x", name, int64(s.Lease()))
			p.take, p.give = m.RLock, m.RUnlock
		default:
			m := etcdsync.NewRWMutex(s, name)
			p.key = fmt.Sprintf("%s/write/%x", name, int64(s.Lease()))
			p.take, p.give = m.Lock, m.Unlock
		}
		p.got = r12Go(func() error { return p.take(ctx) })
		waitKeys(t, admin, name+"/", i+1)
		parts = append(parts, p)
	}
	expected := func() map[int]bool {
		out := map[int]bool{}
		var sum int64
		for _, p := range parts {
			if p.gone {
				continue
			}
			if rw {
				if p.w == 1 {
					if len(out) == 0 {
						out[p.i] = true
					}
					return out
				}
				out[p.i] = true
				continue
			}
			if sum += p.w; sum > capacity {
				return out
			}
			out[p.i] = true
		}
		return out
	}
	check := func(step string) {
		t.Helper()
		exp := expected()
		for _, p := range parts {
			if p.result {
				continue
			}
			switch {
			case p.gone:
				err := r12Result(t, p.got, 5*time.Second, fmt.Sprintf("%s: participant %d, key gone", step, p.i))
				p.result = true
				if err == nil {
					t.Errorf("%s: participant %d holds after its key went", step, p.i)
				} else if !errors.Is(err, etcdsync.ErrSessionExpired) {
					t.Errorf("%s: participant %d: %v, want ErrSessionExpired", step, p.i, err)
				}
			case exp[p.i]:
				err := r12Result(t, p.got, testTimeout, fmt.Sprintf("%s: participant %d (w %d) may hold", step, p.i, p.w))
				p.result = true
				require.NoError(t, err, "%s: participant %d", step, p.i)
				p.held = true
			}
		}
		grace := time.After(100 * time.Millisecond)
		for _, p := range parts {
			if p.result {
				continue
			}
			select {
			case err := <-p.got:
				p.result = true
				t.Errorf("%s: participant %d (w %d) returned out of turn: %v (expected holders %v)", step, p.i, p.w, err, exp)
			case <-grace:
				grace = closedTime()
			}
		}
	}
	check("start")
	rnd := newR12Rand(seed)
	for step := 0; ; step++ {
		var live []*r12Part
		for _, p := range parts {
			if !p.gone && !(p.held && p.result && p.give == nil) {
				live = append(live, p)
			}
		}
		if len(live) == 0 {
			break
		}
		var what string
		switch op := rnd.intn(5); {
		case op <= 2: // release a holder, if any
			var holders []*r12Part
			for _, p := range live {
				if p.held {
					holders = append(holders, p)
				}
			}
			if len(holders) == 0 {
				continue
			}
			p := holders[rnd.intn(len(holders))]
			require.NoError(t, p.give(ctx), "release of participant %d", p.i)
			p.gone, p.result = true, true
			what = fmt.Sprintf("step %d: participant %d released", step, p.i)
		case op == 3: // revoke a lease
			p := live[rnd.intn(len(live))]
			require.NoError(t, p.s.Close())
			p.gone = true
			p.result = p.result || p.held
			what = fmt.Sprintf("step %d: participant %d's session closed (held %v)", step, p.i, p.held)
		default: // one transaction deletes up to three keys
			var ops []clientv3.Op
			var ids []int
			for _, j := range rnd.perm(len(live))[:min(3, len(live))] {
				p := live[j]
				ops = append(ops, clientv3.OpDelete(p.key))
				ids = append(ids, p.i)
				p.gone = true
				p.result = p.result || p.held
			}
			_, err := admin.Txn(ctx).Then(ops...).Commit()
			require.NoError(t, err)
			what = fmt.Sprintf("step %d: participants %v deleted in one revision", step, ids)
		}
		check(what)
		if t.Failed() {
			return
		}
	}
	waitCount(t, admin, name+"/", 5*time.Second, func(n int) bool { return n == 0 })
}

func closedTime() <-chan time.Time {
	ch := make(chan time.Time)
	close(ch)
	return ch
}

// r12Rand is a small deterministic generator (xorshift).
type r12Rand struct{ x uint64 }

func newR12Rand(seed int64) *r12Rand { return &r12Rand{x: uint64(seed)*2654435761 + 88172645463325252} }

func (r *r12Rand) intn(n int) int {
	r.x ^= r.x << 13
	r.x ^= r.x >> 7
	r.x ^= r.x << 17
	return int(r.x % uint64(n))
}

func (r *r12Rand) perm(n int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = i
	}
	for i := n - 1; i > 0; i-- {
		j := r.intn(i + 1)
		p[i], p[j] = p[j], p[i]
	}
	return p
}

// Semaphore: weights 1..capacity, holders and waiters released, revoked
// and deleted (several in one revision) in random orders; exactly the FIFO
// prefix that fits holds after every step, and nobody who may hold waits.
func TestR12SemaphoreModel(t *testing.T) {
	t.Parallel()
	c := single(t)
	for seed := int64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r12Model(t, c, fmt.Sprintf("r12semmodel%d", seed), false, 4, []int64{2, 1, 3, 1, 4, 1, 1, 2, 3, 1}, seed)
		})
	}
}

// RWMutex: readers and writers released, revoked and deleted in random
// orders; after every step the first writer alone, or the readers before
// the first writer, hold.
func TestR12RWMutexModel(t *testing.T) {
	t.Parallel()
	c := single(t)
	for seed := int64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r12Model(t, c, fmt.Sprintf("r12rwmodel%d", seed), true, 0, []int64{0, 0, 1, 0, 0, 1, 1, 0, 1, 0}, seed)
		})
	}
}

// The model on three members, each participant's client on all of them.
func TestR12ModelThree(t *testing.T) {
	t.Parallel()
	c := three(t)
	t.Run("semaphore", func(t *testing.T) {
		r12Model(t, c, "r12sem3", false, 3, []int64{1, 3, 2, 1, 1, 2, 3, 1}, 7)
	})
	t.Run("rwmutex", func(t *testing.T) {
		r12Model(t, c, "r12rw3", true, 0, []int64{1, 0, 0, 1, 0, 1, 0, 0}, 7)
	})
}

// A join while the session's last read share is releasing waits for the
// release, and then queues a new key behind the writer that was waiting.
func TestR12JoinWhileLastShareReleasing(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	cli, p := r12Proxied(t, c)
	defer p.SetLatency(0)
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	a, b := etcdsync.NewRWMutex(s, "r12closing"), etcdsync.NewRWMutex(s, "r12closing")
	require.NoError(t, a.RLock(ctx))
	oldRev := a.Rev()
	w := etcdsync.NewRWMutex(session(t, admin), "r12closing")
	wgot := r12Go(func() error { return w.Lock(ctx) })
	waitKeys(t, admin, "r12closing/", 2)

	p.SetLatency(time.Second)
	ugot := r12Go(func() error { return a.RUnlock(ctx) })
	waitCount(t, admin, "r12closing/read/", testTimeout, func(n int) bool { return n == 0 })
	bgot := r12Go(func() error { return b.RLock(ctx) })
	require.NoError(t, r12Result(t, wgot, testTimeout, "writer after the read key's delete"))
	require.NoError(t, r12Result(t, ugot, testTimeout, "RUnlock"))
	p.SetLatency(0)
	r12NotYet(t, bgot, 500*time.Millisecond, "RLock joined while the writer holds")
	require.NoError(t, w.Unlock(ctx))
	require.NoError(t, r12Result(t, bgot, testTimeout, "RLock after the writer"))
	require.Greater(t, b.Rev(), oldRev, "a new read key")
	require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
	require.NoError(t, b.RUnlock(ctx))
	require.Empty(t, keys(t, admin, "r12closing/"))
}

// The session ends while two values share its read hold: both see it
// (Done closed, Err wraps ErrSessionClosed), and RUnlock says not held.
func TestR12SessionEndsWithShares(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t))
	a, b := etcdsync.NewRWMutex(s, "r12end"), etcdsync.NewRWMutex(s, "r12end")
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	ad := a.Done()
	require.NoError(t, s.Close())
	within(t, ad, testTimeout, "a's Done")
	within(t, b.Done(), testTimeout, "b's Done")
	require.ErrorIs(t, a.Err(), etcdsync.ErrSessionClosed)
	require.ErrorIs(t, b.Err(), etcdsync.ErrSessionClosed)
	require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, b.RUnlock(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, b.RLock(ctx), etcdsync.ErrSessionExpired)
	require.Empty(t, keys(t, admin, "r12end/"))
}

// Shares of one value and of two values released in every order, an
// RUnlock that fails before sending (ended ctx) keeps the share; Done and
// Err follow each value's own shares.
func TestR12ShareCounting(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t))
	a, b := etcdsync.NewRWMutex(s, "r12count"), etcdsync.NewRWMutex(s, "r12count")
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	bd := b.Done()
	require.NoError(t, a.RUnlock(ctx))
	require.NoError(t, a.RUnlock(ctx))
	require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
	select {
	case <-a.Done():
	default:
		t.Error("a's Done open after its last share")
	}
	require.NoError(t, b.Err())
	select {
	case <-bd:
		t.Fatal("b's Done closed while it holds")
	default:
	}
	dead, cancel := context.WithCancel(ctx)
	cancel()
	require.Error(t, b.RUnlock(dead))
	require.NoError(t, b.Err(), "a release that sent nothing keeps the share")
	require.Len(t, keys(t, admin, "r12count/read/"), 1)
	require.NoError(t, b.RUnlock(ctx))
	within(t, bd, testTimeout, "b's Done after its release")
	require.ErrorIs(t, b.Err(), etcdsync.ErrLockReleased)
	require.Empty(t, keys(t, admin, "r12count/"))
}

// Many goroutines on two values of one session take and release read
// holds while writers of other sessions come and go: no overlap, nothing
// left.
func TestR12SharedReadStress(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	var x rwCheck
	s := session(t, c.Client(t))
	vals := []*etcdsync.RWMutex{etcdsync.NewRWMutex(s, "r12stress"), etcdsync.NewRWMutex(s, "r12stress")}
	var wg sync.WaitGroup
	for g := 0; g < 6; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rw := vals[g%2]
			for i := 0; i < 8; i++ {
				if err := rw.RLock(ctx); err != nil {
					t.Errorf("RLock: %v", err)
					return
				}
				x.read(t)
				time.Sleep(time.Millisecond)
				x.readers.Add(-1)
				if err := rw.RUnlock(ctx); err != nil {
					t.Errorf("RUnlock: %v", err)
					return
				}
			}
		}()
	}
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rw := etcdsync.NewRWMutex(session(t, c.Client(t)), "r12stress")
			for i := 0; i < 5; i++ {
				if err := rw.Lock(ctx); err != nil {
					t.Errorf("Lock: %v", err)
					return
				}
				x.write(t, rw.Rev())
				time.Sleep(time.Millisecond)
				x.writers.Add(-1)
				if err := rw.Unlock(ctx); err != nil {
					t.Errorf("Unlock: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Empty(t, keys(t, admin, "r12stress/"))
}

// Costs of the try calls: TryAcquire on a free name 1 RPC; with permits
// taken but enough free 2; with too few free 1 RPC and no write; TryRLock
// beside readers 1 RPC.
func TestR12TryCosts(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	var cnt counter
	cli := c.Client(t, cnt.dial()...)
	sm := etcdsync.NewSemaphore(session(t, cli), "r12cost", 3)
	other := etcdsync.NewSemaphore(session(t, admin), "r12cost", 3)
	cnt.take()
	require.NoError(t, sm.TryAcquire(ctx, 2))
	n, m := cnt.take()
	require.Equal(t, int64(1), n, "TryAcquire on a free name: %v", m)
	require.NoError(t, sm.Release(ctx))
	require.NoError(t, other.Acquire(ctx, 1))
	cnt.take()
	require.NoError(t, sm.TryAcquire(ctx, 2))
	n, m = cnt.take()
	require.Equal(t, int64(2), n, "TryAcquire beside a hold: %v", m)
	require.NoError(t, sm.Release(ctx))
	cnt.take()
	rev := storeRev(t, admin)
	require.ErrorIs(t, sm.TryAcquire(ctx, 3), etcdsync.ErrLocked)
	n, m = cnt.take()
	require.Equal(t, int64(1), n, "TryAcquire with too few free: %v", m)
	require.Equal(t, rev, storeRev(t, admin), "a failed TryAcquire wrote")
	require.NoError(t, other.Release(ctx))

	r1 := etcdsync.NewRWMutex(session(t, admin), "r12costrw")
	require.NoError(t, r1.RLock(ctx))
	r2 := etcdsync.NewRWMutex(session(t, cli), "r12costrw")
	cnt.take()
	require.NoError(t, r2.TryRLock(ctx))
	n, m = cnt.take()
	require.Equal(t, int64(1), n, "TryRLock beside a reader: %v", m)
	require.NoError(t, r2.RUnlock(ctx))
	require.NoError(t, r1.RUnlock(ctx))
	require.Empty(t, keys(t, admin, "r12cost"))
}

// Cancels at every moment of Acquire, TryAcquire, RLock and TryRLock,
// waiting or not, leave no key.
func TestR12CancelsLeaveNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	holder := etcdsync.NewSemaphore(session(t, cli), "r12cancel", 3)
	require.NoError(t, holder.Acquire(ctx, 2))
	w := etcdsync.NewRWMutex(session(t, cli), "r12cancelrw")
	s := session(t, cli)
	sm := etcdsync.NewSemaphore(s, "r12cancel", 3)
	rw := etcdsync.NewRWMutex(s, "r12cancelrw")
	for i := 0; i < 48; i++ {
		if i == 24 {
			require.NoError(t, w.Lock(ctx)) // now readers wait too
		}
		cctx, cancel := context.WithTimeout(ctx, time.Duration(i%12)*250*time.Microsecond)
		var err error
		switch i % 4 {
		case 0:
			err = sm.Acquire(cctx, 2)
		case 1:
			err = sm.TryAcquire(cctx, 2)
		case 2:
			err = rw.RLock(cctx)
		case 3:
			err = rw.TryRLock(cctx)
		}
		cancel()
		if err == nil {
			if i%4 < 2 {
				t.Fatalf("trial %d: %d+2 of 3 permits", i, 2)
			}
			require.Less(t, i, 24, "trial %d: a read hold beside the writer", i)
			require.NoError(t, rw.RUnlock(ctx))
		}
		require.Equal(t, []string{holder.Key()}, keys(t, cli, "r12cancel/"), "trial %d", i)
		if i >= 24 {
			require.Equal(t, []string{w.Key()}, keys(t, cli, "r12cancelrw/"), "trial %d", i)
		}
	}
	require.NoError(t, w.Unlock(ctx))
	require.NoError(t, holder.Release(ctx))
	waitCount(t, cli, "r12cancel", 5*time.Second, func(n int) bool { return n == 0 })
}

// One Semaphore value, Acquire from two goroutines: one holds, the other
// waits for its Release, then holds at a later revision.
func TestR12SemaphoreValueTwoGoroutines(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	sm := etcdsync.NewSemaphore(session(t, c.Client(t)), "r12two", 3)
	g1 := r12Go(func() error { return sm.Acquire(ctx, 1) })
	g2 := r12Go(func() error { return sm.Acquire(ctx, 2) })
	var first error
	select {
	case first = <-g1:
	case first = <-g2:
	case <-time.After(testTimeout):
		t.Fatal("neither Acquire returned")
	}
	require.NoError(t, first)
	rev := sm.Rev()
	require.Len(t, keys(t, admin, "r12two/"), 1)
	select {
	case err := <-g2:
		require.NoError(t, err)
		t.Fatal("both Acquires of one value hold")
	case err := <-g1:
		require.NoError(t, err)
		t.Fatal("both Acquires of one value hold")
	case <-time.After(300 * time.Millisecond):
	}
	// whichever is left
	both := make(chan error, 2)
	go func() {
		select {
		case err := <-g1:
			both <- err
		case err := <-g2:
			both <- err
		}
	}()
	require.NoError(t, sm.Release(ctx))
	require.NoError(t, r12Result(t, both, testTimeout, "second Acquire"))
	require.Greater(t, sm.Rev(), rev)
	require.NoError(t, sm.Release(ctx))
	require.Empty(t, keys(t, admin, "r12two/"))
}

// Invariant "Nested names" (a holder of NAME/x never blocks NAME) against the recipe
// layout: a Mutex on "NAME/write" holds the key NAME/write/<hex>, which is a
// writer of the RWMutex NAME; the documented exception. A Mutex on NAME/x
// for another x does not block it.
func TestR12NestedMutexBlocksRWMutex(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	m := etcdsync.NewMutex(session(t, c.Client(t)), "r12nest/write")
	require.NoError(t, m.Lock(ctx))
	rw := etcdsync.NewRWMutex(session(t, c.Client(t)), "r12nest")
	require.ErrorIs(t, rw.TryRLock(ctx), etcdsync.ErrLocked, "a Mutex on r12nest/write is a writer of r12nest")
	require.NoError(t, m.Unlock(ctx))
	other := etcdsync.NewMutex(session(t, c.Client(t)), "r12nest/other")
	require.NoError(t, other.Lock(ctx))
	require.NoError(t, rw.TryLock(ctx), "a Mutex on r12nest/other does not block r12nest")
	require.NoError(t, rw.Unlock(ctx))
	require.NoError(t, other.Unlock(ctx))
}

// Keys ahead deleted (in one revision) after a waiter's enqueue was applied
// but before its reply arrived and its watches exist: the waiter holds.
func TestR12AheadGoneBeforeWatches(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	t.Run("semaphore", func(t *testing.T) {
		a := etcdsync.NewSemaphore(session(t, admin), "r12early", 3)
		require.NoError(t, a.Acquire(ctx, 2))
		b := etcdsync.NewSemaphore(session(t, admin), "r12early", 3)
		require.NoError(t, b.Acquire(ctx, 1))
		cli, p := r12Proxied(t, c)
		sm := etcdsync.NewSemaphore(session(t, cli), "r12early", 3)
		p.SetLatency(time.Second)
		defer p.SetLatency(0)
		got := r12Go(func() error { return sm.Acquire(ctx, 3) })
		waitKeys(t, admin, "r12early/", 3)
		_, err := admin.Txn(ctx).Then(clientv3.OpDelete(a.Key()), clientv3.OpDelete(b.Key())).Commit()
		require.NoError(t, err)
		require.NoError(t, r12Result(t, got, testTimeout, "waiter whose keys ahead went before its watches"))
		p.SetLatency(0)
		require.NoError(t, sm.Release(ctx))
	})
	t.Run("reader", func(t *testing.T) {
		w1 := etcdsync.NewRWMutex(session(t, admin), "r12earlyrw")
		require.NoError(t, w1.Lock(ctx))
		w2 := etcdsync.NewRWMutex(session(t, admin), "r12earlyrw")
		w2got := r12Go(func() error { return w2.Lock(ctx) })
		waitKeys(t, admin, "r12earlyrw/", 2)
		cli, p := r12Proxied(t, c)
		rw := etcdsync.NewRWMutex(session(t, cli), "r12earlyrw")
		p.SetLatency(time.Second)
		defer p.SetLatency(0)
		got := r12Go(func() error { return rw.RLock(ctx) })
		waitKeys(t, admin, "r12earlyrw/", 3)
		_, err := admin.Delete(ctx, "r12earlyrw/write/", clientv3.WithPrefix())
		require.NoError(t, err)
		require.ErrorIs(t, r12Result(t, w2got, testTimeout, "deleted writer"), etcdsync.ErrSessionExpired)
		require.NoError(t, r12Result(t, got, testTimeout, "reader whose writers ahead went before its watches"))
		p.SetLatency(0)
		require.NoError(t, rw.RUnlock(ctx))
	})
}
