package etcdsync

// Sweeping strays: a key this session may have written but no call owns
// (a create whose outcome was unknown, a withdraw that failed) is removed
// by a sweeper that watches for it, however late the server applies the
// create, and never touches a hold a restarted process resumes.

import (
	"context"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// sweep keeps a create of key whose outcome this session could not learn
// from leaving a key behind, however late the server applies it (a request
// that a member cut off from its peers forwarded to the leader can be applied
// when the partition heals). Until the session ends, it deletes every key at
// key with this session's lease, created after the session began, that no
// primitive of the session holds or waits with. It does not block.
func (s *Session) sweep(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.swept[key]; !ok && s.goLocked(func() { s.sweepKey(key) }) {
		s.swept[key] = nil
	}
}

// created records that an acquire of this session created key at rev, so
// that a sweeper of the key leaves that create to the acquire (which holds
// it, or withdraws it).
func (s *Session) created(key string, rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if revs, ok := s.swept[key]; ok {
		s.swept[key] = append(revs, rev)
	}
}

// disown forgets that an acquire of this session created key at rev (its
// withdraw failed): a sweeper of the key removes it.
func (s *Session) disown(key string, rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if revs, ok := s.swept[key]; ok {
		s.swept[key] = slices.DeleteFunc(revs, func(r int64) bool { return r == rev })
	}
}

// oursLocked reports whether an acquire of this session created kv (see
// created), and forgets that create and any before it. s.mu is held.
func (s *Session) oursLocked(kv *mvccpb.KeyValue) bool {
	key := string(kv.Key)
	revs := s.swept[key]
	i := slices.Index(revs, kv.CreateRevision)
	if i < 0 {
		return false
	}
	s.swept[key] = slices.Delete(revs, 0, i+1)
	return true
}

// sweepKey reads key, then watches its creates, until the session ends.
func (s *Session) sweepKey(key string) {
	for s.ctx.Err() == nil {
		if resp, err := s.client.Get(s.ctx, key); err == nil {
			if len(resp.Kvs) > 0 {
				s.unstray(resp.Kvs[0])
			}
			s.watchCreates(key, resp.Header.Revision+1)
		}
		if sleep(s.ctx, retryPause) != nil {
			return
		}
	}
}

// watchCreates unstrays each key created at key from revision from, until the
// watch fails or the session ends.
func (s *Session) watchCreates(key string, from int64) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(s.ctx))
	defer cancel()
	for wr := range s.client.Watch(ctx, key, clientv3.WithRev(from), clientv3.WithFilterDelete()) {
		if wr.Err() != nil {
			return
		}
		for _, ev := range wr.Events {
			if ev.IsCreate() {
				s.unstray(ev.Kv)
			}
		}
	}
}

// made reports whether kv is a key this session created: it has the
// session's lease and was created after the session began (a restarted
// process's key, WithLease, was created before).
func (s *Session) made(kv *mvccpb.KeyValue) bool {
	return clientv3.LeaseID(kv.Lease) == s.id && kv.CreateRevision > s.startRev
}

// unstray deletes kv's key at its create revision when this session made it
// and, once this session's primitives have let go of the key, it is still
// there: nothing of the session owns it.
func (s *Session) unstray(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	if !s.made(kv) {
		return
	}
	// Wait until no primitive of the session uses the key: an acquire that
	// created kv has recorded it by then, and the key is left alone.
	if claimed, _ := s.claim(s.ctx, key, true, func() bool { return s.oursLocked(kv) }, nil); !claimed {
		return
	}
	defer s.releaseKey(key)
	for s.ctx.Err() == nil {
		ctx, cancel := context.WithTimeout(s.ctx, cleanupTimeout)
		err := deleteAtRev(ctx, s.client, key, kv.CreateRevision)
		cancel()
		if err == nil || sleep(s.ctx, retryPause) != nil {
			return
		}
	}
}

// cleanupTimeout bounds the library's own cleanup RPCs (deleting a key left
// by a failed or cancelled acquire) that run after the caller's context ended.
const cleanupTimeout = 5 * time.Second
