package etcdsync

// One Shards.Run's loop (type shardsRun, for shards.go): it keeps the
// latest view of the members and shard holders, plans this member's part
// (plan, from shardplan.go's pure functions), and starts and stops the
// shards' goroutines (start, running Shards.serve), at most maxShardTries
// trying at once; each goroutine is joined by the loop (exits) before Run
// returns.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

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

// plan computes this member's part of the plan from the current view; nil
// while the view does not show this member yet.
func (r *shardsRun) plan() (*shardPlan, error) {
	members, holder := shardsView(r.sh.name, r.sh.n, r.view.Members)
	me := slices.IndexFunc(members, func(e Entry) bool { return e.Key == r.me })
	if me < 0 {
		if r.seen {
			return nil, fmt.Errorf("%w: shards %s: this member's key %s is gone", ErrNotHeld, r.sh.name, r.me)
		}
		return nil, nil // a view from before the join
	}
	r.seen = true
	if err := r.sh.agreesWith(members[:me]); err != nil {
		return nil, err
	}
	members = slices.DeleteFunc(members, func(m Entry) bool { // a newer member with another n is refused, and leaves
		n, _, ok := memberShards(m.Value)
		return !ok || n != r.sh.n
	})
	me = slices.IndexFunc(members, func(e Entry) bool { return e.Key == r.me })
	held := make([]int, len(members)) // shards each member holds, by the view
	byLease := make(map[clientv3.LeaseID]int, len(members))
	for j, m := range members {
		byLease[m.Lease] = j
	}
	var free []int
	for i, h := range holder {
		switch {
		case !h.Held:
			if _, mine := r.running[i]; !mine {
				free = append(free, i)
			}
		default:
			if j, member := byLease[h.Lease]; member {
				held[j]++
			}
		}
	}
	held[me] = len(r.running) // this member's own count is the one it keeps
	caps := make([]int, len(members))
	for j, m := range members {
		_, caps[j], _ = memberShards(m.Value)
	}
	targets := spread(r.sh.n, caps)
	return &shardPlan{target: targets[me], take: picks(free, targets, held, me)}, nil
}
