package queue

// The enqueue (enqueue, tryEnqueue, turns): one transaction writes the keys
// of one acquire if absent and lists their queues (or, for a try, writes
// only where nothing is there); its response gives a turn per key
// (turn.queued: its place, with the keys ahead of it), and says whether the
// keys of one acquire share one create revision. The wait for a turn is in
// turn.go, a key's place in its queue in place.go.

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// enqueue writes our keys if absent and reads their queues, in one
// transaction: every key, or (when one exists) none, so that the keys of
// one call share one create revision. A key that already exists with our
// lease is ours: a resumed hold after a restart with WithLease, or a create
// the client retried after it committed. It returns one turn per slot, in
// the slots' order, also with an error (for the cleanup).
func enqueue(ctx context.Context, sls []*Slot, val string) ([]turn, error) {
	lease := sls[0].session.Lease()
	cmps := make([]clientv3.Cmp, 0, len(sls))
	then := make([]clientv3.Op, 0, 2*len(sls))
	els := make([]clientv3.Op, 0, 2*len(sls))
	for _, sl := range sls {
		list := sl.listOp()
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(sl.key), "=", 0))
		then = append(then, clientv3.OpPut(sl.key, val, clientv3.WithLease(lease)), list)
		els = append(els, clientv3.OpGet(sl.key), list)
	}
	resp, err := sls[0].session.client.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
	return turns(ctx, sls, resp, err, val, true)
}

// turns makes the turns of an enqueue's response (see queued), and checks
// that the keys of one call share one create revision: those this session
// had on some of the names but not all (a restarted process's, WithLease),
// or from different calls, are an error wrapping ErrInvalidArgument (the
// caller withdraws those it may).
//
// Where the transaction wrote, every key has the response's revision; where
// it did not, a key of ours that exists has its own, and one that does not
// would come after every key listed. listed says whether the response has,
// per slot, the get of our key (empty after a put) and the list.
func turns(ctx context.Context, sls []*Slot, resp *clientv3.TxnResponse, err error, val string, listed bool) ([]turn, error) {
	if errors.Is(err, rpctypes.ErrTooManyOps) { // refused: nothing written
		err = fmt.Errorf("%w: %d names in one transaction are more than the server's --max-txn-ops allows (128 by default: 64 names): %w", ErrInvalidArgument, len(sls), err)
	}
	ts := make([]turn, len(sls))
	for i, sl := range sls {
		switch {
		case err != nil:
			ts[i] = turn{place: place{Slot: sl}, wrote: Unsure(err)}
		case resp.Succeeded:
			ts[i] = turn{place: place{Slot: sl, rev: resp.Header.Revision}, hdr: resp.Header, wrote: true}
		default:
			ts[i] = turn{place: place{Slot: sl, rev: resp.Header.Revision + 1}, hdr: resp.Header}
		}
	}
	if err != nil || !listed {
		return ts, err
	}
	var errs []error
	for i := range ts {
		errs = append(errs, ts[i].queued(ctx, resp.Responses[2*i:2*i+2], val))
	}
	if err := errors.Join(errs...); err != nil {
		return ts, err
	}
	for i := range ts[1:] {
		if (ts[i].value == nil) != (ts[i+1].value == nil) || ts[i].rev != ts[i+1].rev {
			return ts, fmt.Errorf("%w: this session's keys on %s (create revision %d) and %s (%d) are not from one acquire: release them first",
				ErrInvalidArgument, ts[i].key, ts[i].rev, ts[i+1].key, ts[i+1].rev)
		}
	}
	return ts, nil
}

// tryEnqueue writes our keys only if nothing at all is under any NAME/
// (under NAME/<Rule.free>): one RPC and no write when a name is held. When
// a compare fails although nothing blocks us (only nested keys NAME/x/…, or
// keys that leave us room), it falls back to enqueue. The returned turns
// have keys ahead where a name is held; the caller then withdraws the keys
// it wrote.
func tryEnqueue(ctx context.Context, sls []*Slot, val string) ([]turn, error) {
	lease := sls[0].session.Lease()
	cmps := make([]clientv3.Cmp, 0, 2*len(sls))
	then := make([]clientv3.Op, 0, len(sls))
	els := make([]clientv3.Op, 0, 2*len(sls))
	for _, sl := range sls {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(sl.prefix+sl.rule.free), "=", 0).WithPrefix(),
			clientv3.Compare(clientv3.CreateRevision(sl.key), "=", 0)) // ours may lie outside rule.free
		then = append(then, clientv3.OpPut(sl.key, val, clientv3.WithLease(lease)))
		els = append(els, clientv3.OpGet(sl.key), sl.listOp())
	}
	resp, qerr := sls[0].session.client.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
	ts, err := turns(ctx, sls, resp, qerr, val, qerr == nil && !resp.Succeeded)
	if err != nil || resp.Succeeded || slices.ContainsFunc(ts, func(t turn) bool { return t.blocked() || t.value != nil }) {
		return ts, err
	}
	return enqueue(ctx, sls, val)
}
