package etcdsync

// Reporting: what the core tells whoever reports on it, through one
// interface the core owns. The core never calls the reporting code any other
// way: a session made WithLogger or WithMetrics gets its reports from those
// options (metrics.go); without either it has none, and a report costs one
// nil check.

import (
	"context"
	"time"
)

// reports receives a session's state changes, as they happen. Its methods
// must not block.
type reports interface {
	sessionBegan(s *Session)
	// sessionEnded is told once the session's holds have ended.
	sessionEnded(s *Session, cause error)
	keepaliveFailed(s *Session, err error)
	keepaliveAcked(s *Session, rtt time.Duration)
	// actedLate is told, each time the keepalive loop's timer fires (a beat
	// or the deadline due), how long after it was due the loop ran: a
	// process short of CPU runs late.
	actedLate(s *Session, late time.Duration)
	acquireFailed(sl *slot, err error)
	// holdBegan is told when an acquire hands out h, after wait; a hold
	// joined (counted) again is told again.
	holdBegan(h *hold, wait time.Duration)
	// holdEnded is told when h ended with cause (released or lost), before
	// its Done closes.
	holdEnded(h *hold, cause error)
}

// reportEnd tells the session's end, if anyone listens.
func (s *Session) reportEnd() {
	if s.rep != nil {
		s.rep.sessionEnded(s, context.Cause(s.ctx))
	}
}
