package queue

// The enqueue (type turn, and enqueue, tryEnqueue): one transaction writes
// the keys of one acquire if absent and lists their queues (or, for a try,
// writes only where nothing is there); its response gives a turn per key,
// with the keys ahead of it, and says whether the keys of one acquire share
// one create revision. A turn is one key's place in its queue; the wait for
// it is in turn.go.

import (
	"context"
	"errors"
	"fmt"
	"slices"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// turn is the outcome of an acquire: our key's create revision, the keys
// ahead of it and the header of the read that listed them.
type turn struct {
	*Slot
	rev   int64
	value []byte // our key's value when it already existed (non-nil), else nil
	ahead []*mvccpb.KeyValue
	// far and farN are the weight and number of blocking keys listed
	// ahead that a waiter does not keep in ahead (see keepNearest): it
	// watches only a few, so it keeps only the nearest.
	far  int64
	farN int
	// peers is how many keys like ours that do not block us (readers, to
	// a reader) lie between the nearest key that blocks us and ours, as
	// the last list showed (unknownPeers when that is not known): a
	// waiter with frontKeys of them ahead is not at the front (turn.front).
	// peersNext is how many lie between the two nearest keys that block
	// us, which peers takes in when the nearest goes (turn.drop).
	peers, peersNext int
	// unlisted: a limited list (Rule.newest) did not reach the oldest key:
	// older keys may block us too. far and farN then count one such key,
	// unseen, so that only a read that lists them lets the turn come.
	unlisted bool
	hdr      *pb.ResponseHeader
	wrote    bool // this call may have written the key
	// also are the keys of the same acquire on other names (a MultiLock's),
	// whose deletes end our wait too (stream.check).
	also []string
	// gone is the latest delete of a key listed ahead seen since: one
	// stream delivers the deletes of different watches out of revision
	// order (a watch's events wait until the server has sent its creation),
	// and the turn comes no earlier than the latest.
	gone int64
}

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
			ts[i] = turn{Slot: sl, wrote: Unsure(err)}
		case resp.Succeeded:
			ts[i] = turn{Slot: sl, hdr: resp.Header, wrote: true, rev: resp.Header.Revision}
		default:
			ts[i] = turn{Slot: sl, hdr: resp.Header, rev: resp.Header.Revision + 1}
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

// queued fills t from an enqueue's responses for its slot (rs: the get of
// our key, empty after a put, and the list): our key as it already was, if
// the response has it (it must have our lease and, under a rule that weighs
// keys, the value val asks for), and the keys ahead of it (t.rev: our key's
// create revision if it is new). When a limited list leaves it unsure
// whether anything blocks us (only keys that do not block, or keys newer
// than our existing key, were listed), it lists them all (one more RPC,
// bounded by ctx).
func (t *turn) queued(ctx context.Context, rs []*pb.ResponseOp, val string) error {
	var own *mvccpb.KeyValue
	if kvs := rs[0].GetResponseRange().GetKvs(); len(kvs) > 0 { // none after a put
		own = kvs[0]
		if lease := t.session.Lease(); clientv3.LeaseID(own.Lease) != lease {
			return fmt.Errorf("%w: key %s exists with lease %x, not this session's %x", ErrInvalidArgument, t.key, own.Lease, int64(lease))
		}
		if t.rule.weigh != nil && string(own.Value) != val { // a restarted process's key, resumed
			return fmt.Errorf("%w: key %s exists with %q, and this call asks for %q: acquire it as it is, then release it", ErrInvalidArgument, t.key, own.Value, val)
		}
		t.rev, t.value = own.CreateRevision, append([]byte{}, own.Value...)
	}
	rr := rs[1].GetResponseRange()
	if err := t.list(rr.Kvs, rr.More); err != nil {
		return err
	}
	if t.unlisted && (own != nil || len(t.ahead) < t.needs()) {
		if err := t.relist(ctx, t.hdr.Revision, true); err != nil {
			return err
		}
	}
	if own != nil {
		t.wrote = t.mine(own) // after t.ahead: a waiting key is ours to withdraw
	}
	return nil
}

// needs is how many blocking keys a limited list must show to be enough:
// a waiter, one more than the front holds (turn.front), as fewer with
// older keys unlisted leave it unsure whether it is at the front (the
// second in line behind keys of nested names would watch its predecessor
// alone and read on its release); a try that wrote nothing needs one (the
// name is taken).
func (t *turn) needs() int {
	if !t.wrote {
		return 1
	}
	return frontKeys + 1
}

// list sets the keys ahead from kvs, a list of the keys under the prefix
// (listOpts: under a limited list, newest first; more: keys it did not
// reach exist).
func (t *turn) list(kvs []*mvccpb.KeyValue, more bool) error {
	if t.rule.newest && len(kvs) > 0 && kvs[0].CreateRevision > kvs[len(kvs)-1].CreateRevision {
		kvs = slices.Clone(kvs)
		slices.Reverse(kvs)
	}
	ahead, err := t.blocking(kvs, t.rev)
	if err != nil {
		return err
	}
	t.ahead, t.far, t.farN, t.peers, t.peersNext, t.unlisted = ahead, 0, 0, 0, 0, t.rule.newest && more
	if t.unlisted && len(ahead) > 0 {
		t.far, t.farN = 1, 1
	}
	if t.rule.peers && len(ahead) > 0 {
		near, next := ahead[len(ahead)-1].CreateRevision, ahead[max(0, len(ahead)-2)].CreateRevision
		for _, kv := range kvs {
			switch {
			case kv.CreateRevision >= t.rev || !t.rule.In(t.prefix, kv):
			case kv.CreateRevision > near:
				t.peers++
			case kv.CreateRevision > next:
				t.peersNext++
			}
		}
	}
	return nil
}

// mine reports whether a key of ours that existed before this call is this
// call's to withdraw if it fails: one this session made (a create applied
// late), or a restarted process's key (WithLease) that still waits; never a
// restarted process's hold.
func (t *turn) mine(kv *mvccpb.KeyValue) bool {
	return t.session.made(kv) || t.blocked()
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
