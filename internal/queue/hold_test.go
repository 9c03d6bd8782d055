package queue

// A hold's end and the release in flight, without a server: the end cancels
// the release that holds the place (Hold.cancelOnEnd), and only that one.

import (
	"context"
	"errors"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
)

// heldKey returns a hold of key n/1 at revision 5 on a session that has no
// client (nothing here sends a request), and the session's cancel.
func heldKey() (*Hold, context.CancelCauseFunc) {
	ctx, cancel := context.WithCancelCause(context.Background())
	s := &Session{ctx: ctx, cancel: cancel, ka: newKeepalive(time.Time{})}
	s.reg = registry{s: s, keys: map[string]keyUse{}, swept: map[string][]int64{}}
	sl := &Slot{session: s, prefix: "n/", key: "n/1", kind: "mutex", rule: &Exclusive}
	s.reg.keys[sl.key] = keyUse{}
	return newHold(sl, 5, &pb.ResponseHeader{Revision: 5}), cancel
}

// The place is one release's: a second is refused and left alone by the
// end; the end cancels the first; a release registered on a hold that has
// ended is cancelled at once; one that left the place is not cancelled; the
// session's end cancels through its holds' end too.
func TestHoldsEndCancelsTheReleaseInFlight(t *testing.T) {
	h, _ := heldKey()
	first, cancelFirst := context.WithCancel(context.Background())
	second, cancelSecond := context.WithCancel(context.Background())
	defer cancelFirst()
	defer cancelSecond()
	if !h.cancelOnEnd(cancelFirst) {
		t.Fatal("the first release was refused the place")
	}
	if h.cancelOnEnd(cancelSecond) {
		t.Fatal("a second release took the place")
	}
	h.finish(errors.New("lost"))
	if first.Err() == nil {
		t.Fatal("the hold's end did not cancel the release in its place")
	}
	if second.Err() != nil {
		t.Fatal("the hold's end cancelled a release it refused the place")
	}
	h.cancelOnEnd(nil)
	late, cancelLate := context.WithCancel(context.Background())
	defer cancelLate()
	h.cancelOnEnd(cancelLate)
	if late.Err() == nil {
		t.Fatal("a release registered on an ended hold was not cancelled at once")
	}

	left, _ := heldKey()
	gone, cancelGone := context.WithCancel(context.Background())
	defer cancelGone()
	left.cancelOnEnd(cancelGone)
	left.cancelOnEnd(nil)
	left.finish(errors.New("lost"))
	if gone.Err() != nil {
		t.Fatal("the hold's end cancelled a release that had left the place")
	}

	ended, endSession := heldKey()
	inFlight, cancelInFlight := context.WithCancel(context.Background())
	defer cancelInFlight()
	ended.cancelOnEnd(cancelInFlight)
	endSession(ErrSessionClosed)
	ended.session.finishHolds()
	if inFlight.Err() == nil {
		t.Fatal("the session's end did not cancel the release")
	}
}
