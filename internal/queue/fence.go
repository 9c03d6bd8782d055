package queue

// The release of several holds in one transaction (Unhold: a MultiLock's),
// each deleting its key only while it is the hold's incarnation, as one
// hold's release does (Hold.Unhold, hold.go).

import (
	"context"

	clientv3 "go.etcd.io/etcd/client/v3"
)

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
