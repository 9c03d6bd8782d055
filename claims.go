package etcdsync

// Key claims: a session's primitives share one key per name (NAME/<lease>,
// fixed by interop), so a session reserves a key for one hold at a time
// (or, under a shared rule, counts the holds that share it), and bounds
// each call by the session's life.

import (
	"context"
	"fmt"
)

// claimKey reserves key for one primitive of this session: the key name is
// fixed by interop (NAME/<lease>), so two holders on one session would share
// a key. With wait it blocks until the key is free or ctx ends; without, it
// returns ErrLocked at once. A reservation is freed by releaseKey, once.
func (s *Session) claimKey(ctx context.Context, key string, wait bool) error {
	_, err := s.claim(ctx, key, wait, nil, nil)
	return err
}

// shareKey is claimKey for a key whose holds the session's primitives share
// (an RWMutex's read key): when the session holds the key and one read shows
// it still there, it joins that hold (counted, see hold.leave) and returns
// it; else it reserves the key and returns nil. With wait, an acquire or a
// release of the key in flight is waited for; without, it is an error
// wrapping ErrLocked.
func (s *Session) shareKey(ctx context.Context, key string, wait bool) (*hold, error) {
	joinable := func(h *hold) bool { return h.rule.shared && h.live() && !h.closing } // not a Mutex on NAME/read
	for {
		var seen *hold
		if _, err := s.claim(ctx, key, wait, nil, func(h *hold) bool {
			if joinable(h) {
				seen = h
			}
			return seen != nil
		}); err != nil || seen == nil {
			return nil, err
		}
		// Its key may be gone unnoticed (deleted, nobody watching).
		if err := s.checkBounded(ctx, seen); err != nil {
			if seen.live() {
				return nil, err
			}
			continue // it ended: wait until it is freed
		}
		s.mu.Lock()
		joined := s.keys[key].hold == seen && joinable(seen)
		if joined {
			seen.shares++
		}
		s.mu.Unlock()
		if joined {
			return seen, nil
		}
	}
}

// bound returns ctx ended also by the session's end, and its cancel.
func (s *Session) bound(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

// checkBounded is h.check bounded by ctx and by the session's end.
func (s *Session) checkBounded(ctx context.Context, h *hold) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	_, err := h.check(ctx)
	switch {
	case err == nil:
	case s.ctx.Err() != nil:
		return s.endedErr()
	default:
		return fmt.Errorf("etcdsync: join the session's hold of %s: %w", h.key, err)
	}
	return nil
}

// claim is claimKey, except that once the key is free it claims nothing and
// returns false when skip (called with s.mu held) says so, and that while
// the key is held it claims nothing and returns false when join (called
// with s.mu held) takes a share of the hold.
func (s *Session) claim(ctx context.Context, key string, wait bool, skip func() bool, join func(*hold) bool) (bool, error) {
	for {
		s.mu.Lock()
		use, taken := s.keys[key]
		if !taken {
			if skip != nil && skip() {
				s.mu.Unlock()
				return false, nil
			}
			s.keys[key] = keyUse{} // a channel is made only when someone waits
			s.mu.Unlock()
			return true, nil
		}
		if join != nil && use.hold != nil && join(use.hold) {
			s.mu.Unlock()
			return false, nil
		}
		if use.freed == nil && wait {
			use.freed = make(chan struct{})
			s.keys[key] = use
		}
		freed := use.freed
		s.mu.Unlock()
		if !wait {
			return false, fmt.Errorf("%w: %s is held, or waited for, by this session", ErrLocked, key)
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return false, fmt.Errorf("etcdsync: waiting for %s held in this session: %w", key, ctx.Err())
		case <-s.ctx.Done():
			return false, s.endedErr()
		}
	}
}

// keyUse is a key reserved by a primitive of the session (claimKey).
type keyUse struct {
	freed chan struct{} // closed when released, or when a hold can be joined (wake); nil until someone waits
	hold  *hold         // its hold, once it holds
}

// wakeLocked lets the callers waiting for key (claim) look again: its hold
// began, or can be joined again. s.mu is held.
func (s *Session) wakeLocked(key string) {
	if use := s.keys[key]; use.freed != nil {
		close(use.freed)
		use.freed = nil
		s.keys[key] = use
	}
}

// releaseKey frees a reservation made by claimKey.
func (s *Session) releaseKey(key string) {
	s.mu.Lock()
	freed := s.keys[key].freed
	delete(s.keys, key)
	s.mu.Unlock()
	if freed != nil {
		close(freed)
	}
}
