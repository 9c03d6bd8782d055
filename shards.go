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
// and no two members ever run one shard at once (after lost contact, also
// when the session is closed meanwhile: its revoke waits for the fns, up
// to the slack; a live session's Close ends them as the keys go, so stop
// Run first). When fn returns while the
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
