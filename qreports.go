package etcdsync

import "time"

// reports receives a session's state changes, as they happen. Its methods
// must not block.
type Reports interface {
	SessionBegan(s *Session)
	// sessionEnded is told once the session's holds have ended.
	SessionEnded(s *Session, cause error)
	KeepaliveFailed(s *Session, err error)
	KeepaliveAcked(s *Session, rtt time.Duration)
	// actedLate is told, each time the keepalive loop's timer fires (a beat
	// or the deadline due), how long after it was due the loop ran: a
	// process short of CPU runs late.
	ActedLate(s *Session, late time.Duration)
	AcquireFailed(sl *Slot, err error)
	// holdBegan is told when an acquire hands out h, after wait; a hold
	// joined (counted) again is told again.
	HoldBegan(h *Hold, wait time.Duration)
	// holdEnded is told when h ended with cause (released or lost), before
	// its Done closes.
	HoldEnded(h *Hold, cause error)
}
