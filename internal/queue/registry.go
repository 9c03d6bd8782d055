package queue

// A session's registry of the keys its primitives use (type registry).
//
// Key claims: a session's primitives share one key per name (NAME/<lease>,
// fixed by interop), so a session reserves a key for one hold at a time
// (or, under a shared rule, counts the holds that share it).
//
// Sweeping strays: a key this session may have written but no call owns
// (a create whose outcome was unknown, a withdraw that failed) is removed
// by a sweeper that watches for it, however late the server applies the
// create, and never touches a hold a restarted process resumes.

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// registry is a session's record of the keys its primitives use: the claim
// on each key, its hold once it holds, and the keys its sweepers watch. Its
// mu also guards the holds' shares (Hold.shares, Hold.closing). It is taken
// before the session's own mu, never after.
type registry struct {
	s     *Session
	mu    sync.Mutex
	keys  map[string]keyUse  // key in use by a primitive of this session
	swept map[string][]int64 // keys swept (see sweep) -> revisions of creates by this session's acquires not yet seen by the sweeper
}

// claimKey reserves key for one primitive of this session: the key name is
// fixed by interop (NAME/<lease>), so two holders on one session would share
// a key. With wait it blocks until the key is free or ctx ends; without, it
// returns ErrLocked at once. A reservation is freed by releaseKey, once.
func (r *registry) claimKey(ctx context.Context, key string, wait bool) error {
	_, err := r.claim(ctx, key, wait, nil, nil)
	return err
}

// shareKey is claimKey for a key whose holds the session's primitives share
// (an RWMutex's read key): when the session holds the key and one read shows
// it still there, it joins that hold (counted, see Hold.leave) and returns
// it; else it reserves the key and returns nil. With wait, an acquire or a
// release of the key in flight is waited for; without, it is an error
// wrapping ErrLocked.
func (r *registry) shareKey(ctx context.Context, key string, wait bool) (*Hold, error) {
	joinable := func(h *Hold) bool { return h.rule.shared && h.Live() && !h.closing } // not a Mutex on NAME/read
	for {
		var seen *Hold
		if _, err := r.claim(ctx, key, wait, nil, func(h *Hold) bool {
			if joinable(h) {
				seen = h
			}
			return seen != nil
		}); err != nil || seen == nil {
			return nil, err
		}
		// Its key may be gone unnoticed (deleted, nobody watching).
		if err := r.checkBounded(ctx, seen); err != nil {
			if seen.Live() {
				return nil, err
			}
			continue // it ended: wait until it is freed
		}
		r.mu.Lock()
		joined := r.keys[key].hold == seen && joinable(seen)
		if joined {
			seen.shares++
		}
		r.mu.Unlock()
		if joined {
			return seen, nil
		}
	}
}

// checkBounded is h.check bounded by ctx and by the session's end.
func (r *registry) checkBounded(ctx context.Context, h *Hold) error {
	ctx, cancel := r.s.Bound(ctx)
	defer cancel()
	_, err := h.check(ctx)
	switch {
	case err == nil:
	case r.s.ctx.Err() != nil:
		return r.s.EndedErr()
	default:
		return fmt.Errorf("etcdsync: join the session's hold of %s: %w", h.key, err)
	}
	return nil
}

// claim is claimKey, except that once the key is free it claims nothing and
// returns false when skip (called with r.mu held) says so, and that while
// the key is held it claims nothing and returns false when join (called
// with r.mu held) takes a share of the hold.
func (r *registry) claim(ctx context.Context, key string, wait bool, skip func() bool, join func(*Hold) bool) (bool, error) {
	for {
		r.mu.Lock()
		use, taken := r.keys[key]
		if !taken {
			if skip != nil && skip() {
				r.mu.Unlock()
				return false, nil
			}
			r.keys[key] = keyUse{} // a channel is made only when someone waits
			r.mu.Unlock()
			return true, nil
		}
		if join != nil && use.hold != nil && join(use.hold) {
			r.mu.Unlock()
			return false, nil
		}
		if use.freed == nil && wait {
			use.freed = make(chan struct{})
			r.keys[key] = use
		}
		freed := use.freed
		r.mu.Unlock()
		if !wait {
			return false, fmt.Errorf("%w: %s is held, or waited for, by this session", ErrLocked, key)
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return false, fmt.Errorf("etcdsync: waiting for %s held in this session: %w", key, ctx.Err())
		case <-r.s.ctx.Done():
			return false, r.s.EndedErr()
		}
	}
}

// keyUse is a key reserved by a primitive of the session (claimKey).
type keyUse struct {
	freed chan struct{} // closed when released, or when a hold can be joined (wake); nil until someone waits
	hold  *Hold         // its hold, once it holds
}

// wakeLocked lets the callers waiting for key (claim) look again: its hold
// began, or can be joined again. r.mu is held.
func (r *registry) wakeLocked(key string) {
	if use := r.keys[key]; use.freed != nil {
		close(use.freed)
		use.freed = nil
		r.keys[key] = use
	}
}

// releaseKey frees a reservation made by claimKey.
func (r *registry) releaseKey(key string) {
	r.mu.Lock()
	freed := r.keys[key].freed
	delete(r.keys, key)
	r.mu.Unlock()
	if freed != nil {
		close(freed)
	}
}

// sweep keeps a create of key whose outcome this session could not learn
// from leaving a key behind, however late the server applies it (a request
// that a member cut off from its peers forwarded to the leader can be applied
// when the partition heals). Until the session ends, it deletes every key at
// key with this session's lease, created after the session began, that no
// primitive of the session holds or waits with. It does not block.
func (r *registry) sweep(key string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.swept[key]; !ok && r.s.goWatch(func() { r.sweepKey(key) }) {
		r.swept[key] = nil
	}
}

// created records that an acquire of this session created key at rev, so
// that a sweeper of the key leaves that create to the acquire (which holds
// it, or withdraws it).
func (r *registry) created(key string, rev int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if revs, ok := r.swept[key]; ok {
		r.swept[key] = append(revs, rev)
	}
}

// disown forgets that an acquire of this session created key at rev (its
// withdraw failed): a sweeper of the key removes it.
func (r *registry) disown(key string, rev int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if revs, ok := r.swept[key]; ok {
		r.swept[key] = slices.DeleteFunc(revs, func(r int64) bool { return r == rev })
	}
}

// oursLocked reports whether an acquire of this session created kv (see
// created), and forgets that create and any before it. r.mu is held.
func (r *registry) oursLocked(kv *mvccpb.KeyValue) bool {
	key := string(kv.Key)
	revs := r.swept[key]
	i := slices.Index(revs, kv.CreateRevision)
	if i < 0 {
		return false
	}
	r.swept[key] = slices.Delete(revs, 0, i+1)
	return true
}

// sweepKey reads key, then watches its creates, until the session ends.
func (r *registry) sweepKey(key string) {
	for r.s.ctx.Err() == nil {
		if resp, err := r.s.client.Get(r.s.ctx, key); err == nil {
			if len(resp.Kvs) > 0 {
				r.unstray(resp.Kvs[0])
			}
			r.watchCreates(key, resp.Header.Revision+1)
		}
		if Pause(r.s.ctx) != nil {
			return
		}
	}
}

// watchCreates unstrays each key created at key from revision from, until the
// watch fails or the session ends. A watch the session's end cancelled may
// have been cancelled before the server created it, which can keep its
// gRPC stream open with no watch (see stream.add): the session closes it
// (reapStream).
func (r *registry) watchCreates(key string, from int64) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(r.s.ctx))
	defer cancel()
	defer func() {
		if r.s.ctx.Err() != nil {
			r.s.goReap(func(rctx context.Context) { reapStream(rctx, r.s.client, ctx, key) })
		}
	}()
	for wr := range r.s.client.Watch(ctx, key, clientv3.WithRev(from), clientv3.WithFilterDelete()) {
		if wr.Err() != nil {
			return
		}
		for _, ev := range wr.Events {
			if ev.IsCreate() {
				r.unstray(ev.Kv)
			}
		}
	}
}

// unstray deletes kv's key at its create revision when this session made it
// and, once this session's primitives have let go of the key, it is still
// there: nothing of the session owns it.
func (r *registry) unstray(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	if !r.s.made(kv) {
		return
	}
	// Wait until no primitive of the session uses the key: an acquire that
	// created kv has recorded it by then, and the key is left alone.
	if claimed, _ := r.claim(r.s.ctx, key, true, func() bool { return r.oursLocked(kv) }, nil); !claimed {
		return
	}
	defer r.releaseKey(key)
	for r.s.ctx.Err() == nil {
		ctx, cancel := context.WithTimeout(r.s.ctx, cleanupTimeout)
		err := DeleteAtRev(ctx, r.s.client, key, kv.CreateRevision)
		cancel()
		if err == nil || Pause(r.s.ctx) != nil {
			return
		}
	}
}

// cleanupTimeout bounds the library's own cleanup RPCs (deleting a key left
// by a failed or cancelled acquire) that run after the caller's context ended.
const cleanupTimeout = 5 * time.Second
