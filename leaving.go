package etcdsync

// One party's Leave of a double barrier (type leaving): the order in which a
// round's parties go (etcd's recipe's: the oldest party waits for the
// others' keys to go, then deletes its own and ready, last; every other
// party deletes its own and waits for the oldest's). DoubleBarrier.leave
// runs it; DoubleBarrier.withdraw removes a party's key when Leave fails.

import (
	"context"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// leaving is one Leave: the party's key, created at rev, in the round that
// filled at round.
type leaving struct {
	db         *DoubleBarrier
	rev, round int64
	left       bool // our key is deleted
	sent       bool // a delete of our key failed: it may have committed
	alone      bool // the last read showed our key the round's last
}

// run takes steps until the Leave is done, pausing after a failed RPC or a
// broken watch, until ctx ends.
func (l *leaving) run(ctx context.Context) error {
	for {
		done, err := l.step(ctx)
		switch {
		case done:
			return err
		case ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			if err := queue.Pause(ctx); err != nil {
				return err
			}
		}
	}
}

// step reads the round's parties (the keys created before it filled) and
// takes one step of etcd's recipe's order: the last party out closes the
// round (deletes ready with its key); the oldest waits for the newest to
// go; any other party deletes its key and waits for the oldest to go. It
// reports whether the Leave is done, with its outcome; when not, the error
// that makes it read again after a pause, if any.
func (l *leaving) step(ctx context.Context) (bool, error) {
	db := l.db
	cli := db.sl.Session().Client()
	resp, err := cli.Txn(ctx).Then(clientv3.OpGet(db.waiters, clientv3.WithPrefix(), clientv3.WithKeysOnly()), clientv3.OpGet(db.ready)).Commit()
	if err != nil {
		return false, err
	}
	// Oldest and newest go by mod revision, as in etcd's recipe (a key is
	// never written twice: it is its create revision).
	var oldest, newest *mvccpb.KeyValue
	in := false
	for _, kv := range resp.Responses[0].GetResponseRange().GetKvs() {
		if kv.CreateRevision >= l.round {
			continue
		}
		in = in || string(kv.Key) == db.sl.Key()
		if oldest == nil || kv.ModRevision < oldest.ModRevision {
			oldest = kv
		}
		if newest == nil || kv.ModRevision > newest.ModRevision {
			newest = kv
		}
	}
	switch {
	case !l.left && !in && l.sent: // our delete committed, or the lease ended: out either way
		l.left = true
	case !l.left && !in:
		return true, db.gone(resp.Header.Revision)
	}
	if oldest == nil { // all have left
		return l.close(ctx, resp.Responses[1].GetResponseRange().GetKvs())
	}
	first := !l.left && string(oldest.Key) == db.sl.Key()
	l.alone = first && oldest == newest
	var target, own string
	switch {
	case l.alone:
		return l.depart(ctx, true)
	case first:
		target, own = string(newest.Key), db.sl.Key()
	default:
		if !l.left {
			if done, err := l.depart(ctx, false); done || err != nil {
				return done, err
			}
		}
		target = string(oldest.Key)
	}
	ev, err := watchFor(ctx, cli, resp.Header.Revision+1, target, mvccpb.DELETE, own)
	if err == nil && string(ev.Kv.Key) == db.sl.Key() {
		return true, db.gone(ev.Kv.ModRevision)
	}
	return false, err
}

// depart deletes our key, and when last, the round's ready with it (then
// the Leave is done).
func (l *leaving) depart(ctx context.Context, last bool) (bool, error) {
	ok, at, err := l.db.depart(ctx, l.rev, l.round, last)
	switch {
	case err != nil:
		l.sent = true
		return false, err
	case !ok && !l.sent:
		return true, l.db.gone(at)
	}
	l.left = true // by this delete, an earlier one, or the lease's end
	return last, nil
}

// close deletes ready once every party has left, if it is still the
// round's: its last party could not (it crashed, or its Leave was
// cancelled).
func (l *leaving) close(ctx context.Context, ready []*mvccpb.KeyValue) (bool, error) {
	if len(ready) == 0 || ready[0].ModRevision != l.round {
		return true, nil
	}
	_, err := l.db.sl.Session().Client().Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(l.db.ready), "=", l.round)).
		Then(clientv3.OpDelete(l.db.ready)).Commit()
	return err == nil, err
}
