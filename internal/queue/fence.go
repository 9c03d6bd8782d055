package queue

// A hold's fenced writes and release: the guard (a comparison true only
// while the hold is current), Do and Put under it, and the release, which
// deletes a held key only while it is the hold's incarnation (its create
// revision), one hold or several in one transaction, so that a retried or
// late release never deletes a newer hold.

import (
	"context"
	"errors"
	"fmt"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Guard is the comparison that holds while h is the current hold; with no
// hold it is a valid comparison that is always false.
func (h *Hold) Guard(prefix string) clientv3.Cmp {
	if !h.Live() {
		return clientv3.Compare(clientv3.CreateRevision(prefix), "<", 0)
	}
	return clientv3.Compare(clientv3.CreateRevision(h.key), "=", h.rev)
}

// do runs ops in one transaction only while h is current. When the hold is
// gone it ends h and returns an error wrapping ErrNotHeld.
func (h *Hold) do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	if !h.Live() {
		return nil, fmt.Errorf("%w: no current hold", ErrNotHeld)
	}
	// The Else range keeps the transaction linearizable: one of compares and
	// serializable reads alone is served by any member, which may lag.
	resp, err := h.session.client.Txn(ctx).If(h.Guard(h.prefix)).Then(ops...).Else(clientv3.OpGet(h.key, clientv3.WithCountOnly())).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcdsync: guarded transaction on %s: %w", h.key, err)
	}
	if !resp.Succeeded {
		h.Lost(resp.Header.Revision)
		return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.key, h.rev)
	}
	return resp, nil
}

// Put sets the key's value while h is current, and only over the value of
// our last put (or the create): a put of ours that the server applies late,
// after a newer one, finds the key changed and writes nothing. When the key
// has changed since our last put (such a late put of ours landed first, or
// someone else's), the newer put writes over it. Puts run one at a time.
// When the hold is gone it ends h and returns an error wrapping ErrNotHeld.
func (h *Hold) Put(ctx context.Context, val string) (*pb.ResponseHeader, error) {
	x := h.extra()
	x.writing.Lock()
	defer x.writing.Unlock()
	if x.wrote == 0 {
		x.wrote = h.rev
	}
	for range putTries {
		if !h.Live() {
			return nil, fmt.Errorf("%w: no current hold", ErrNotHeld)
		}
		resp, err := h.session.client.Txn(ctx).
			If(h.Guard(h.prefix), clientv3.Compare(clientv3.ModRevision(h.key), "=", x.wrote)).
			Then(clientv3.OpPut(h.key, val, clientv3.WithLease(h.session.Lease()))).
			Else(clientv3.OpGet(h.key)).
			Commit()
		if err != nil {
			return nil, fmt.Errorf("etcdsync: set the value of %s: %w", h.key, err)
		}
		if resp.Succeeded {
			x.wrote = resp.Header.Revision
			return resp.Header, nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 || kvs[0].CreateRevision != h.rev {
			h.Lost(resp.Header.Revision)
			return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.key, h.rev)
		}
		x.wrote = kvs[0].ModRevision
	}
	return nil, fmt.Errorf("etcdsync: set the value of %s: it changed under each of %d tries", h.key, putTries)
}

// putTries bounds how often put writes over a value it did not expect.
const putTries = 4

// Unhold deletes the key at the held revision only (a retried release never
// deletes a newer hold). It is bounded by ctx and by the hold itself: when
// the hold ends meanwhile (the session ended, or reached its local deadline;
// the key was deleted) it returns at once. On an RPC error the hold stays, so
// it can be retried; when there was nothing to delete the hold ends and the
// error wraps ErrLockReleased. The hold ends once the delete has committed.
func (h *Hold) Unhold(ctx context.Context) error {
	if err := h.unholdable(ctx); err != nil {
		return err
	}
	// The session's end cancels the request at once (Bound), whatever the
	// session's loop is doing; the hold's own end, through finish.
	ctx, cancel := h.session.Bound(ctx)
	defer cancel()
	if h.cancelOnEnd(cancel) {
		defer h.cancelOnEnd(nil)
	} else { // another release of h is in flight: the hold's context bounds this one
		defer context.AfterFunc(h.Context(), cancel)()
	}
	h.releasing.Add(1)
	resp, err := h.session.client.Txn(ctx).If(h.Guard(h.prefix)).Then(clientv3.OpDelete(h.key)).Commit()
	if err != nil {
		return h.released(err, false, 0)
	}
	return h.released(nil, resp.Succeeded, resp.Header.Revision)
}

// Unhold releases several holds of one session in one RPC (see Hold.Unhold
// for each): one transaction deletes each key that is still its hold's, at
// one revision. It returns one error per hold, nil for those released; it
// is bounded by ctx and, with one hold, by that hold.
func Unhold(ctx context.Context, hs []*Hold) []error {
	if len(hs) == 1 {
		return []error{hs[0].Unhold(ctx)}
	}
	errs := make([]error, len(hs))
	var live []int
	var ops []clientv3.Op
	for i, h := range hs {
		if errs[i] = h.unholdable(ctx); errs[i] == nil {
			live = append(live, i)
			ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{h.Guard(h.prefix)}, []clientv3.Op{clientv3.OpDelete(h.key)}, nil))
		}
	}
	if len(live) == 0 {
		return errs
	}
	for _, i := range live {
		hs[i].releasing.Add(1)
	}
	resp, err := hs[live[0]].session.client.Txn(ctx).Then(ops...).Commit()
	for j, i := range live {
		if err != nil {
			errs[i] = hs[i].released(err, false, 0)
		} else {
			errs[i] = hs[i].released(nil, resp.Responses[j].GetResponseTxn().Succeeded, resp.Header.Revision)
		}
	}
	return errs
}

// unholdable is nil when h can be released under ctx, else why not: the
// hold has ended, or ctx has (nothing is sent: the hold stays as it was).
func (h *Hold) unholdable(ctx context.Context) error {
	switch {
	case !h.Live():
		return fmt.Errorf("%w: not held", ErrLockReleased)
	case ctx.Err() != nil:
		return fmt.Errorf("etcdsync: release %s: %w", h.key, ctx.Err())
	}
	return nil
}

// released ends a release of h that Unhold sent (h.releasing counted it):
// err is the RPC's error, else deleted says whether the key was still h's
// at revision rev. It returns the release's error for the caller.
func (h *Hold) released(err error, deleted bool, rev int64) error {
	switch {
	case err != nil:
		// The delete may have committed; a Done watch that saw it while
		// it was in flight has reported a release. From now on a loss is
		// someone else's doing.
		h.releasing.Add(-1)
		switch {
		case h.Live():
			return fmt.Errorf("etcdsync: release %s: %w", h.key, err)
		case !errors.Is(h.Err(), ErrLockReleased):
			return fmt.Errorf("%w: %s: the hold ended while releasing: %w", ErrLockReleased, h.key, h.Err())
		}
		return nil
	case deleted:
		h.stop(ErrLockReleased)
		return nil
	}
	h.releasing.Add(-1)
	h.Lost(rev)
	h.stop(nil)
	return fmt.Errorf("%w: %s at revision %d was already gone", ErrLockReleased, h.key, h.rev)
}
