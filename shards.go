package etcdsync

// Shards: n units of work shared by the members of a name, each run by one
// member at a time. Which keys block whom:
//
//   - NAME/members/<lease-hex>: a Group (group.go); blocks nobody. Its value
//     says how many shards the member runs ("n=12 max=0"): members that
//     disagree on n are refused.
//   - NAME/<i>/<lease-hex>, for shard i in 0..n-1: a Mutex of its own, on
//     the name NAME/<i> (mutex.go): its holder runs the shard, and it blocks
//     every other member from that shard. Members only try to lock (TryRun):
//     nobody queues.
//
// No coordinator: each member watches both kinds of keys under NAME/ (one
// watch), and from that ordered view computes how many shards each member
// should hold (plan: n spread over the members in join order, the oldest
// taking the remainder, within each member's cap) and which free shards each
// member short of its share takes. A member over its share stops the fns of
// its highest shards and releases them once they returned; a member short of
// it tries to lock the free shards the plan gives it. A join moves only what
// the newcomer takes, a leave only the leaver's shards.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Shards shares n shards, 0 to n-1, among the members of a name: Run calls
// a function for each shard this member holds, each shard on one member at
// a time, balanced over the members as they come and go. All methods are
// safe for concurrent use.
type Shards struct {
	s    *Session
	name string
	n    int
	max  int   // WithMaxShards; 0: no cap
	bad  error // why Run refuses (a bad name, session, n or option)
}

// ShardsOption configures NewShards.
type ShardsOption interface{ applyShards(*Shards) }

type shardsOption func(*Shards)

func (f shardsOption) applyShards(sh *Shards) { f(sh) }

// WithMaxShards caps the shards this member holds at k (a small instance
// takes less): the others then take more, and shards no member has room
// for stay unheld until one has. The default, 0, is no cap; k < 0 makes
// Run return an error wrapping ErrInvalidArgument.
func WithMaxShards(k int) ShardsOption {
	return shardsOption(func(sh *Shards) {
		if k < 0 {
			sh.bad = firstErr(sh.bad, fmt.Errorf("%w: WithMaxShards(%d): a cap below 0", ErrInvalidArgument, k))
		}
		sh.max = k
	})
}

// firstErr returns the first of errs that is not nil.
func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// NewShards returns the shards 0 to n-1 of name for session s. It does not
// touch etcd. A nil session, an invalid name, n <= 0 or a bad option is
// reported by Run.
func NewShards(s *Session, name string, n int, opts ...ShardsOption) *Shards {
	sh := &Shards{s: s, name: name, n: n}
	switch {
	case s == nil:
		sh.bad = fmt.Errorf("%w: nil session", ErrInvalidArgument)
	case queue.CheckName(name) != nil:
		sh.bad = queue.CheckName(name)
	case n <= 0:
		sh.bad = fmt.Errorf("%w: shards %s: n = %d, want at least 1", ErrInvalidArgument, name, n)
	}
	for _, o := range opts {
		o.applyShards(sh)
	}
	return sh
}

// ShardName returns the name of shard i's lock under name: NAME/<i>.
// `lockctl holders NAME/<i>` shows its holder.
func ShardName(name string, i int) string { return name + "/" + strconv.Itoa(i) }

// membersName is the name of a Shards' Group.
func membersName(name string) string { return name + "/members" }

// Run joins the members of the shards and, for each shard this member
// holds, calls fn(ctx, shard) in a goroutine of its own. fn's ctx has Run's
// ctx's values; it ends when the shard moves to another member (a join
// rebalances; context.Cause then wraps ErrLockReleased), when its hold is
// lost (context.Cause says why, as for every hold), or when Run ends (the
// cause is Run's error);
// HoldFrom(ctx) gives the shard's key and fencing token. A shard is
// released only after its fn returned: a fn slow to stop delays the move,
// and no two members ever run one shard at once. When fn returns while the
// shard is still held, it runs again after a pause that doubles, from 100
// ms to 30 s, while it keeps failing (each error is logged and counted,
// WithLogger, WithMetrics).
//
// A member tries to lock at most 8 shards at once: its start or a join
// takes its shards a few at a time.
//
// Run blocks. When ctx ends it stops every fn, waits for them, releases
// the shards, leaves the members, and returns an error wrapping ctx.Err().
// When the session ends it returns, once every fn returned, an error
// wrapping ErrSessionExpired (or ErrSessionClosed); when someone deletes
// this member's key, one wrapping ErrNotHeld. The name's n is its oldest
// member's: a member whose n differs gets an error wrapping
// ErrInvalidArgument that names both counts, and disturbs nobody (the
// others leave it out of their plans while it is listed). A nil fn
// or a bad argument of NewShards is an error wrapping ErrInvalidArgument (or
// ErrInvalidName); nothing is written then.
func (sh *Shards) Run(ctx context.Context, fn func(ctx context.Context, shard int) error) error {
	if err := firstErr(sh.bad, nilFn(fn)); err != nil {
		return err
	}
	q := sh.s.core()
	if err := queue.ClosedClient(q.Client()); err != nil {
		return err
	}
	if q.Err() != nil {
		return q.EndedErr()
	}
	if err := sh.agreed(ctx); err != nil {
		return err
	}
	g := NewGroup(sh.s, membersName(sh.name))
	if err := g.Join(ctx, sh.value()); err != nil {
		return fmt.Errorf("etcdsync: shards %s: join: %w", sh.name, err)
	}
	r := &shardsRun{sh: sh, ctx: ctx, fn: fn, me: g.Key(), running: make(map[int]*shardRun), exits: make(chan shardExit, sh.n), held: make(chan int, sh.n), tried: make(map[int]int64)}
	vctx, stopViews := context.WithCancel(ctx)
	views := watchKeys(vctx, q.Client(), sh.name+"/", sh.inView)
	err := r.loop(ctx, views, q.Done())
	stopViews()
	for range views { // the view's goroutines end with vctx
	}
	if errors.Is(err, ErrNotHeld) && q.Err() == nil { // the member's key went: with its lease (revoked)?
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), q.TTL())
		if ttl, terr := q.Client().TimeToLive(tctx, q.Lease()); terr == nil && ttl.TTL <= 0 {
			err = fmt.Errorf("%w: shards %s: its lease 0x%x is gone (revoked or expired)", ErrSessionExpired, sh.name, int64(q.Lease()))
		}
		cancel()
	}
	if errors.Is(err, ErrNotHeld) && q.Err() != nil {
		err = q.EndedErr()
	}
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), q.TTL())
	defer cancel()
	if lerr := g.Leave(lctx); lerr != nil && q.Err() == nil && !errors.Is(lerr, ErrLockReleased) {
		err = queue.WithCleanup(err, lerr)
	}
	return err
}

// nilFn reports a nil fn.
func nilFn(fn func(context.Context, int) error) error {
	if fn == nil {
		return fmt.Errorf("%w: nil fn", ErrInvalidArgument)
	}
	return nil
}

// value is this member's value: its n, its cap, and where it runs.
func (sh *Shards) value() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("n=%d max=%d host=%s pid=%d", sh.n, sh.max, host, os.Getpid())
}

// memberShards parses a member's value: its n and its cap.
func memberShards(v []byte) (n, max int, ok bool) {
	_, err := fmt.Sscanf(string(v), "n=%d max=%d", &n, &max)
	return n, max, err == nil && n > 0 && max >= 0
}

// agreed returns an error wrapping ErrInvalidArgument when the oldest
// member runs another n than this one, or has a value that is not a
// member's.
func (sh *Shards) agreed(ctx context.Context) error {
	ms, _, err := GroupMembers(ctx, sh.s.core().Client(), membersName(sh.name))
	if err != nil {
		return fmt.Errorf("etcdsync: shards %s: %w", sh.name, err)
	}
	return sh.agreesWith(ms)
}

// agreesWith is agreed on the members ms, in join order: the name's n is
// its oldest member's (a newer member with another n is refused, and the
// others leave it out of their plans).
func (sh *Shards) agreesWith(ms []Entry) error {
	if len(ms) == 0 {
		return nil
	}
	if n, _, ok := memberShards(ms[0].Value); !ok || n != sh.n {
		return fmt.Errorf("%w: shards %s: this member asks for %d shards, and member %s runs with %q: changing n is a new name",
			ErrInvalidArgument, sh.name, sh.n, ms[0].Key, ms[0].Value)
	}
	return nil
}

// inView reports whether key, under prefix NAME/, is in a Shards' view: a
// member NAME/members/<hex>, or a shard's key NAME/<i>/<hex>.
func (sh *Shards) inView(prefix, key string) bool {
	rest, _ := strings.CutPrefix(key, prefix)
	dir, _, ok := strings.Cut(rest, "/")
	if !ok {
		return false
	}
	if dir == "members" {
		return queue.IsChild(prefix+"members/", key)
	}
	i, err := strconv.Atoi(dir)
	return err == nil && i >= 0 && i < sh.n && strconv.Itoa(i) == dir && queue.IsChild(prefix+dir+"/", key)
}

// shardsRun is one Run's state, kept by its loop.
type shardsRun struct {
	sh      *Shards
	ctx     context.Context // Run's: its values reach fn
	fn      func(context.Context, int) error
	me      string            // this member's key
	running map[int]*shardRun // shards this member holds or tries to
	exits   chan shardExit
	held    chan int      // shards whose lock was just taken (serve)
	tries   int           // shards of running still trying to lock (at most maxShardTries)
	tried   map[int]int64 // shard -> the revision of the view its try that found it taken started from
	view    GroupView
	seen    bool // a view has shown this member
}

// shardRun is one shard's goroutine: it tries to lock the shard and runs
// fn while it holds it; stop ends it, with the cause fn's context gets.
type shardRun struct {
	stop     context.CancelCauseFunc
	stopping bool
	trying   bool  // its lock is not taken yet
	from     int64 // the revision of the view it started from
}

// shardExit is what a shard's goroutine ends with.
type shardExit struct {
	shard int
	err   error
}

// loop keeps the plan with each view and each shard's end, until ctx or the
// session (done) ends, or this member's key goes; then it stops every shard
// and waits for them.
func (r *shardsRun) loop(ctx context.Context, views <-chan GroupView, done <-chan struct{}) error {
	q := r.sh.s.core()
	var err error
	for err == nil {
		select {
		case <-ctx.Done():
			err = fmt.Errorf("etcdsync: shards %s: %w", r.sh.name, ctx.Err())
		case <-done:
			err = q.EndedErr()
		case v, ok := <-views:
			if !ok {
				err = firstErr(ctx.Err(), q.Err(), fmt.Errorf("%w: shards %s: the members' watch ended (client closed)", ErrInvalidArgument, r.sh.name))
				continue
			}
			r.view = v
			err = r.rebalance()
		case e := <-r.exits:
			r.ended(e)
			r.drain()
			err = r.rebalance()
		case i := <-r.held:
			r.taken(i)
			r.drain()
			err = r.rebalance()
		}
	}
	for _, sr := range r.running {
		sr.stop(err)
	}
	for len(r.running) > 0 {
		select {
		case e := <-r.exits:
			r.ended(e)
		case i := <-r.held:
			r.taken(i)
		}
	}
	return err
}

// drain records the ends and the locks taken that the shards' goroutines
// have reported since, so that one plan follows a burst of them.
func (r *shardsRun) drain() {
	for {
		select {
		case e := <-r.exits:
			r.ended(e)
		case i := <-r.held:
			r.taken(i)
		default:
			return
		}
	}
}

// taken records that shard i's lock was taken: the next shard may be tried.
func (r *shardsRun) taken(i int) {
	if sr, ok := r.running[i]; ok && sr.trying {
		sr.trying = false
		r.tries--
	}
}

// ended records the end of a shard's goroutine.
func (r *shardsRun) ended(e shardExit) {
	r.taken(e.shard)
	if errors.Is(e.err, ErrLocked) { // tried again once a view newer than its start still shows it free
		r.tried[e.shard] = r.running[e.shard].from
	}
	delete(r.running, e.shard)
}

// rebalance stops and starts shards as the plan for the current view says.
// It returns an error when this member must stop: an older member runs
// another n, or this member's key is gone.
func (r *shardsRun) rebalance() error {
	first := !r.seen
	p, err := r.plan()
	if err != nil || p == nil {
		return err
	}
	if first {
		r.dropStale()
	}
	live := 0
	for _, sr := range r.running {
		if !sr.stopping {
			live++
		}
	}
	if over := live - p.target; over > 0 {
		held := make([]int, 0, len(r.running))
		for i, sr := range r.running {
			if !sr.stopping {
				held = append(held, i)
			}
		}
		slices.SortFunc(held, func(a, b int) int { // tries first, then the highest shards
			if ta, tb := r.running[a].trying, r.running[b].trying; ta != tb {
				if ta {
					return 1
				}
				return -1
			}
			return a - b
		})
		for _, i := range held[len(held)-over:] {
			r.running[i].stopping = true
			r.running[i].stop(fmt.Errorf("%w: shard %d of %s moves to another member", ErrLockReleased, i, r.sh.name))
		}
	}
	for _, i := range p.take {
		if len(r.running) >= p.target {
			break
		}
		if r.tries >= maxShardTries {
			break // the next ones once a try is over (taken, ended)
		}
		if rev, ok := r.tried[i]; ok && rev >= r.view.Rev {
			continue // found taken since this view: wait for a newer one
		}
		r.start(i)
	}
	return nil
}

// maxShardTries is how many shards a member tries to lock at once: a
// start or a join takes its shards a few at a time, so that the server's
// queue of writes stays short (etcd renews a lease only once it has applied
// what it committed before), and members that start together share the
// shards before one has taken them all.
const maxShardTries = 8

// dropStale deletes the shards' keys with this member's lease, which it does
// not run yet (its first plan): a process that adopted its lease from one
// that stopped (Orphan, then WithLease) finds the old process's holds, which
// nobody runs and nobody else may take. Each is deleted at its create
// revision (bounded by CreateGrace), so that it is free again, with a new
// fencing token once taken; a delete that fails leaves the key to the lease.
func (r *shardsRun) dropStale() {
	lease := r.sh.s.Lease()
	for _, e := range r.view.Members {
		if e.Lease != lease || strings.HasPrefix(e.Key, membersName(r.sh.name)+"/") {
			continue
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(r.ctx), queue.CreateGrace)
		_ = queue.DeleteAtRev(ctx, r.sh.s.core().Client(), e.Key, e.Rev)
		cancel()
	}
}

// start starts shard i's goroutine: it tries to lock the shard (reporting
// on r.held when it took it), runs fn while it holds it, and releases it
// after fn returned.
func (r *shardsRun) start(i int) {
	ctx, stop := context.WithCancelCause(context.WithoutCancel(r.ctx)) // Run's values; ended by stop
	r.running[i] = &shardRun{stop: stop, trying: true, from: r.view.Rev}
	r.tries++
	go func() {
		defer stop(nil)
		took := func() {
			select {
			case r.held <- i:
			case <-ctx.Done(): // the loop stopped it, and reads held no longer for it
			}
		}
		r.exits <- shardExit{shard: i, err: r.sh.serve(ctx, i, took, r.fn)}
	}()
}

// serve tries to lock shard i and, once it holds it (it calls took), runs
// fn, again after a pause when fn returns (see Run); it releases the shard
// once fn returned and ctx (the shard's) or the hold ended. It returns an
// error wrapping ErrLocked when the shard is taken; after another failure it
// pauses first (queue.Pause), so that a member does not retry at once.
func (sh *Shards) serve(ctx context.Context, i int, took func(), fn func(context.Context, int) error) error {
	m := NewMutex(sh.s, ShardName(sh.name, i))
	err := m.TryRun(ctx, func(hctx context.Context) error {
		took()
		pause := shardPause
		for {
			err := fn(hctx, i)
			if hctx.Err() != nil {
				return err
			}
			if err != nil {
				sh.s.rep.shardFailed(sh.name, i, err)
				pause = min(2*pause, maxShardPause)
			} else {
				pause = shardPause
			}
			if queue.Sleep(hctx, pause) != nil {
				return nil
			}
		}
	})
	for m.Check() == nil { // a release that failed: the shard stays ours until it is done
		rctx, cancel := context.WithTimeout(context.Background(), sh.s.core().TTL())
		uerr := m.Unlock(rctx)
		cancel()
		if uerr == nil || errors.Is(uerr, ErrLockReleased) || queue.Pause(sh.s.core().Ctx()) != nil {
			break
		}
	}
	if err != nil && !errors.Is(err, ErrLocked) && ctx.Err() == nil {
		_ = queue.Pause(ctx) // a try or hold that failed otherwise (etcd refusing writes, say) is not tried again at once
	}
	return err
}

// The pauses before a shard's fn runs again: shardPause after a nil return,
// doubling after each error up to maxShardPause.
const (
	shardPause    = 100 * time.Millisecond
	maxShardPause = 30 * time.Second
)
