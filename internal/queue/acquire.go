package queue

// The acquire step every primitive shares (acquireSlots; Slot.acquire for
// one slot): reserve the keys in the session (registry.go), write them if
// absent and list the queues in one transaction (enqueue.go), wait for the
// turn (turn.go) unless it is a try, and on any failure withdraw the key
// this call may have written (Slot.Withdraw), however late the server
// applies the create. Every
// request goes through the client's interfaces (KV, Watcher, Lease,
// Maintenance), so that a namespace, a wrapper, an in-process client or
// etcd's gRPC proxy sees it.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// WithCleanup returns err, the reason a call failed, with cleanup, the
// error of its cleanup if any, on one line (a log's record stays one),
// both in its chain.
func WithCleanup(err, cleanup error) error {
	if cleanup == nil {
		return err
	}
	return fmt.Errorf("%w; %w", err, cleanup)
}

// DeleteAtRev deletes key only while it is the incarnation created at rev, so
// that however late the server applies it, it never deletes a later one.
func DeleteAtRev(ctx context.Context, cli *clientv3.Client, key string, rev int64) error {
	_, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", rev)).
		Then(clientv3.OpDelete(key)).Commit()
	return err
}

// final reports whether a wait that failed with err must not retry: our key
// is gone, or a key ahead breaks the rule (another capacity, say).
func final(err error) bool {
	return errors.Is(err, ErrSessionExpired) || errors.Is(err, ErrInvalidArgument)
}

// Mode says how acquire waits.
type Mode int

const (
	WaitTurn Mode = iota // wait in the queue (Lock, Campaign)
	TryTurn              // never wait (TryLock)
	JoinTurn             // never wait, in etcd or for the session's own use of the key (Group.Join)
)

// CreateGrace is how long an acquire's create may run on after the caller's
// context (or the session) ended: long enough to learn, in most cases, whether
// it committed, so that the cleanup knows what to delete.
const CreateGrace = time.Second

// acquireSlots is Slot.acquire for the keys of several slots of one session at
// once (a MultiLock), all or none: one transaction writes them all, at one
// create revision, so that two callers of overlapping sets wait for each
// other in one order, whatever order they name them in; the turn of each
// is then waited for in turn. Only the first may be under a shared rule,
// when it is the only one. The value returned is the first key's.
func acquireSlots(ctx context.Context, sls []*Slot, val string, m Mode) ([]*Hold, []byte, error) {
	rep := sls[0].session.rep
	if rep == nil {
		return enter(ctx, sls, val, m)
	}
	began := time.Now()
	hs, value, err := enter(ctx, sls, val, m)
	if err != nil {
		rep.AcquireFailed(sls[0], err)
	}
	for _, h := range hs {
		rep.HoldBegan(h, time.Since(began))
	}
	return hs, value, err
}

// enter is acquire, unreported: it enters the queues and comes out holding,
// or with nothing left behind.
func enter(ctx context.Context, sls []*Slot, val string, m Mode) ([]*Hold, []byte, error) {
	sl := sls[0]
	if err := ctx.Err(); err != nil {
		return nil, nil, sl.why(ctx, err)
	}
	if err := sl.session.Err(); err != nil {
		return nil, nil, sl.session.EndedErr()
	}
	if sl.rule.shared {
		switch h, err := sl.session.reg.shareKey(ctx, sl.key, m == WaitTurn); {
		case err != nil:
			return nil, nil, err
		case h != nil:
			return []*Hold{h}, nil, nil
		}
	} else if err := claimKeys(ctx, sls, m == WaitTurn); err != nil {
		return nil, nil, err
	}
	if err := ctx.Err(); err != nil { // it ended as the keys were freed
		releaseKeys(sls)
		return nil, nil, sl.why(ctx, err)
	}
	wctx, cancel := sl.session.Bound(ctx)
	defer cancel()

	// The create is not cancelled with ctx: a cancelled request may still be
	// applied by the server after a cleanup sent behind it (the server can
	// propose it after its context ended), which would leave a key behind.
	// It runs on while ctx lives, and for createGrace after ctx ends.
	ectx, ecancel := context.WithCancel(context.WithoutCancel(wctx))
	defer ecancel()
	stopGrace := context.AfterFunc(wctx, func() { time.AfterFunc(CreateGrace, ecancel) })
	defer stopGrace()
	var ts []turn
	var qerr error
	if m == TryTurn {
		ts, qerr = tryEnqueue(ectx, sls, val)
	} else {
		ts, qerr = enqueue(ectx, sls, val)
	}
	for _, t := range ts {
		if qerr == nil && t.wrote && t.value == nil {
			t.session.reg.created(t.key, t.rev) // a sweeper of the key leaves it to us
		}
	}
	err := qerr
	if err == nil {
		err = wctx.Err()
	}
	if i := slices.IndexFunc(ts, func(t turn) bool { return t.blocked() }); err == nil && i >= 0 && m != WaitTurn {
		err = fmt.Errorf("%w: %s is taken: %s (create revision %d) is ahead", ErrLocked, ts[i].Name(), ts[i].ahead[0].Key, ts[i].ahead[0].CreateRevision)
	}
	for i := range ts {
		for _, o := range ts {
			if len(ts) > 1 && o.key != ts[i].key {
				ts[i].also = append(ts[i].also, o.key)
			}
		}
	}
	// The keys share one revision: those ahead of one are older than all.
	// Once a turn came by waiting, the queues of the later ones have moved
	// too (a MultiLock ahead released all its keys at one revision): one
	// read each says where they stand before any watch.
	var waited int64 // the revision the last wait ended at
	for i := range ts {
		t := &ts[i]
		if err == nil && waited > 0 && t.blocked() {
			if serr := t.settle(wctx, waited); serr != nil && final(serr) {
				err = serr
			}
		}
		if err == nil && t.blocked() {
			var hdr *pb.ResponseHeader
			if hdr, err = t.wait(wctx); err == nil {
				waited = hdr.Revision
			}
		}
	}
	if err == nil && waited > 0 && len(ts) > 1 {
		err = stillOurs(wctx, ts)
	}
	hs := make([]*Hold, 0, len(ts))
	for _, t := range ts {
		if err != nil {
			break
		}
		h := newHold(t.Slot, t.rev, t.hdr)
		hs = append(hs, h)
		if !h.Live() { // the session ended at this instant
			err = sl.session.EndedErr()
		}
	}
	if err == nil {
		return hs, ts[0].value, nil
	}
	err = sl.why(ctx, err)
	gctx, gcancel := sl.session.graced()
	defer gcancel()
	for i, t := range ts {
		switch {
		case qerr != nil && t.wrote && t.hdr == nil: // the create failed, and may yet be applied: the session removes the key if it was, or will be, created
			t.session.reg.sweep(t.key)
		case t.wrote:
			err = WithCleanup(err, t.withdrawIn(gctx, t.rev))
		}
		if i < len(hs) {
			hs[i].finish(err)
		} else {
			t.session.reg.releaseKey(t.key)
		}
	}
	return nil, nil, err
}

// stillOurs checks, in one transaction, that the keys of ts all still
// exist, each at its create revision, and makes that transaction's
// revision the one at which each turn came. A wait watches the other keys
// of its acquire (turn.also) and returns at the delete of one; this closes
// the gaps between the waits.
func stillOurs(ctx context.Context, ts []turn) error {
	keys := make([]string, len(ts))
	for i, t := range ts {
		keys[i] = t.key
	}
	return keysAt(ctx, ts[0].session.client, keys, ts[0].rev, func(hdr *pb.ResponseHeader) {
		for i := range ts {
			ts[i].hdr = hdr
		}
	})
}

// keysAt checks, in one transaction bounded by ctx, that every key of keys
// exists at create revision rev (the keys of one acquire), and passes its
// header to at, if any. A key gone is an error wrapping ErrSessionExpired.
func keysAt(ctx context.Context, cli *clientv3.Client, keys []string, rev int64, at func(*pb.ResponseHeader)) error {
	cmps := make([]clientv3.Cmp, len(keys))
	for i, key := range keys {
		cmps[i] = clientv3.Compare(clientv3.CreateRevision(key), "=", rev)
	}
	// A transaction of compares alone is served as a serializable read (etcd's
	// txn.IsTxnSerializable: no range that is not serializable), by a member
	// that may lag; a plain range in it makes it linearizable.
	linearizable := clientv3.OpGet(keys[0], clientv3.WithCountOnly())
	resp, err := cli.Txn(ctx).If(cmps...).Then(linearizable).Else(linearizable).Commit()
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		return fmt.Errorf("%w: a key of the same acquire on another name went", ErrOwnKeyGone)
	}
	if at != nil {
		at(resp.Header)
	}
	return nil
}

// claimKeys reserves the slots' keys in their session (claimKey), in order;
// on error it frees those it reserved.
func claimKeys(ctx context.Context, sls []*Slot, wait bool) error {
	for i, sl := range sls {
		if err := sl.session.reg.claimKey(ctx, sl.key, wait); err != nil {
			releaseKeys(sls[:i])
			return err
		}
	}
	return nil
}

// releaseKeys frees the slots' reservations.
func releaseKeys(sls []*Slot) {
	for _, sl := range sls {
		sl.session.reg.releaseKey(sl.key)
	}
}

// Unsure reports whether a write that failed with err may have been applied,
// or may still be: anything but the server's definite refusal.
func Unsure(err error) bool {
	code := status.Code(err)
	if ee := (rpctypes.EtcdError{}); errors.As(err, &ee) {
		code = ee.Code()
	}
	switch code {
	case codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated,
		codes.FailedPrecondition, codes.NotFound, codes.OutOfRange:
		return false
	}
	return true
}
