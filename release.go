package etcdsync

// The fenced release: a held key is deleted only while it is the hold's
// (its create revision), one hold or several in one transaction, so that
// a retried or late release never deletes a newer hold.

import (
	"context"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// unhold deletes the key at the held revision only (a retried release never
// deletes a newer hold). It is bounded by ctx and by the hold itself: when the
// hold ends meanwhile (the session reached its local deadline, the key was
// deleted) it returns at once. On an RPC error the hold stays, so it can be
// retried; when there was nothing to delete the hold ends and the error wraps
// ErrLockReleased. The hold ends once the delete has committed.
func (h *hold) unhold(ctx context.Context) error { return unhold(ctx, []*hold{h})[0] }

// unhold releases several holds of one session in one RPC (see hold.unhold
// for each): one transaction deletes each key that is still its hold's, at
// one revision. It returns one error per hold, nil for those released; it
// is bounded by ctx and, with one hold, by that hold.
func unhold(ctx context.Context, hs []*hold) []error {
	errs := make([]error, len(hs))
	var live []int
	for i, h := range hs {
		switch {
		case !h.live():
			errs[i] = fmt.Errorf("%w: not held", ErrLockReleased)
		case ctx.Err() != nil: // nothing is sent: the hold stays as it was
			errs[i] = fmt.Errorf("etcdsync: release %s: %w", h.key, ctx.Err())
		default:
			live = append(live, i)
		}
	}
	if len(live) == 0 {
		return errs
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	txn := hs[live[0]].s.client.Txn(ctx)
	if len(hs) == 1 {
		h := hs[0]
		stop := context.AfterFunc(h.context(), cancel)
		defer stop()
		txn = txn.If(h.guard(h.prefix)).Then(clientv3.OpDelete(h.key))
	} else {
		ops := make([]clientv3.Op, len(live))
		for j, i := range live {
			h := hs[i]
			ops[j] = clientv3.OpTxn([]clientv3.Cmp{h.guard(h.prefix)}, []clientv3.Op{clientv3.OpDelete(h.key)}, nil)
		}
		txn = txn.Then(ops...)
	}
	for _, i := range live {
		hs[i].releasing.Add(1)
	}
	resp, err := txn.Commit()
	for j, i := range live {
		h := hs[i]
		switch {
		case err != nil:
			// The delete may have committed; a Done watch that saw it while
			// it was in flight has reported a release. From now on a loss is
			// someone else's doing.
			h.releasing.Add(-1)
			switch {
			case h.live():
				errs[i] = fmt.Errorf("etcdsync: release %s: %w", h.key, err)
			case !errors.Is(h.err(), ErrLockReleased):
				errs[i] = fmt.Errorf("%w: %s: the hold ended while releasing: %w", ErrLockReleased, h.key, h.err())
			}
		case len(hs) == 1 && resp.Succeeded, len(hs) > 1 && resp.Responses[j].GetResponseTxn().Succeeded:
			h.stop(ErrLockReleased)
		default:
			h.releasing.Add(-1)
			h.lost(resp.Header.Revision)
			h.stop(nil)
			errs[i] = fmt.Errorf("%w: %s at revision %d was already gone", ErrLockReleased, h.key, h.rev)
		}
	}
	return errs
}
