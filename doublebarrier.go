package etcdsync

// The double barrier: a party is one key NAME/waiters/<lease-hex> bound to
// its session's lease; the party whose key makes count puts NAME/ready,
// which lets every party of the round out of Enter; in Leave the oldest
// party waits until the others' keys are gone and deletes its own, with
// ready, last (leaving.go). These are the keys and the Leave
// order of etcd's recipe DoubleBarrier, so parties of the two mix in one
// round.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// DoubleBarrier lets count parties start a phase together (Enter) and
// finish it together (Leave). Each party is a Session: its key is bound to
// the session's lease, so a party that crashes never holds the others
// forever:
//
//   - while it waits in Enter, its key goes with its lease and it no longer
//     counts: the others go on waiting for count parties, and a replacement
//     (the restarted process, with a new Session) takes its place;
//   - once the round has filled, it counts as having left: the others'
//     Leave returns without it.
//
// The keys are those of etcd's recipe DoubleBarrier (NAME/waiters/<id>,
// NAME/ready), and so is the order in which parties leave, so the two
// kinds of party mix in one round. A round is under way from the moment it
// fills until its last party has left; Enter refuses a party that comes
// meanwhile, as it refuses a party beyond count (ErrLocked). etcd's
// recipe lets a party enter while a round is under way, counting the
// parties still leaving; a round with such parties in it behaves as etcd's.
//
// One Session is one party: two DoubleBarrier values on one Session and
// name cannot both be in. All methods are safe for concurrent use; one
// value makes one Enter or Leave at a time.
type DoubleBarrier struct {
	sl      queue.Slot // the party's key NAME/waiters/<lease-hex>, on its session
	waiters string     // NAME/waiters/
	ready   string     // NAME/ready
	count   int
	bad     error // why the name, session or count is unusable, or nil

	mu    sync.Mutex
	busy  bool  // an Enter or Leave of this value runs
	rev   int64 // create revision of the party's key while in, else 0
	round int64 // revision of the put of ready that let the round out of Enter
}

// party places a double barrier party's key under NAME/waiters/; parties
// do not queue, so it has no blocking rule.
var party = queue.Unqueued("waiters/")

// NewDoubleBarrier returns the double barrier on name for count parties,
// with session s as one party. It does not touch etcd. An invalid name, a
// nil session or a count below 1 is reported by every call, with an error
// wrapping ErrInvalidName or ErrInvalidArgument.
func NewDoubleBarrier(s *Session, name string, count int) *DoubleBarrier {
	db := &DoubleBarrier{waiters: name + "/waiters/", ready: name + "/ready", count: count}
	sl, err := queue.NewSlot(s.core(), name, "doublebarrier", &party)
	switch {
	case err != nil:
		db.bad = err
	case count < 1:
		db.bad = fmt.Errorf("%w: double barrier %s: count %d, want at least 1", ErrInvalidArgument, name, count)
	default:
		db.sl = sl
	}
	return db
}

// Enter blocks until count parties, this one included, have entered the
// round, and returns nil; the last of them returns at once. It writes the
// party's key NAME/waiters/<lease-hex> and reads the round in one RPC; the
// party that makes count then puts NAME/ready (one more RPC); the others
// watch for that put and their own key's delete.
//
// A party that comes when count parties have entered before it, or while a
// round is under way (its parties have not all left), gets an error
// wrapping ErrLocked and leaves no key. A party whose key vanishes while it
// waits (its lease ended, someone deleted it) gets ErrSessionExpired at once.
// ctx bounds the wait, and so does the session: when either ends, the error
// says which (ctx's error, or the session's: ErrSessionExpired,
// ErrSessionClosed). On any error the party's key is removed (the removal
// runs under a short context of its own; one the session could not learn
// the outcome of is removed by the session later), so the party is out and
// no key of it is left behind. Enter on a value that is in, or on a second
// value of this Session and name that is, is an error wrapping
// ErrInvalidArgument. A watch that breaks (compaction, a member restart, a
// lost leader) is followed by one read, not by a failure.
func (db *DoubleBarrier) Enter(ctx context.Context) error {
	if _, _, err := db.begin(false); err != nil {
		return err
	}
	rev, round, err := db.enter(ctx)
	db.end(rev, round)
	return err
}

// Leave blocks until every party of the round has left, and returns nil;
// the party is then out, and may Enter the next round. The oldest party
// waits until the others' keys are gone, then deletes its own key and
// NAME/ready in one transaction; every other party deletes its key at once
// and waits for the oldest one's to go (etcd's recipe's order). A party
// whose session ends (a crash) counts as having left, so it never holds the
// others past the end of its lease.
//
// Leave on a value that has not entered is an error wrapping
// ErrInvalidArgument. ctx bounds the wait, and so does the session; when
// either ends the error says which, and the party's key is removed (as in
// Enter): the party is out either way. A party whose key vanished gets
// ErrSessionExpired. RPC errors and broken watches are retried (one read
// after each) until ctx ends.
func (db *DoubleBarrier) Leave(ctx context.Context) error {
	rev, round, err := db.begin(true)
	if err != nil {
		return err
	}
	err = db.leave(ctx, rev, round)
	db.sl.Unreserve()
	db.end(0, 0)
	return err
}

// begin marks a call of this value under way, an Enter on a value that is
// out or (leave) a Leave on one that is in, and returns the round it is in.
func (db *DoubleBarrier) begin(leave bool) (rev, round int64, err error) {
	if db.bad != nil {
		return 0, 0, db.bad
	}
	db.mu.Lock()
	defer db.mu.Unlock()
	switch {
	case db.busy:
		return 0, 0, fmt.Errorf("%w: double barrier %s: an Enter or Leave of this value is under way", ErrInvalidArgument, db.sl.Name())
	case leave && db.rev == 0:
		return 0, 0, fmt.Errorf("%w: double barrier %s: Leave without a successful Enter", ErrInvalidArgument, db.sl.Name())
	case !leave && db.rev != 0:
		return 0, 0, fmt.Errorf("%w: double barrier %s: this value has entered already (Leave first)", ErrInvalidArgument, db.sl.Name())
	}
	db.busy = true
	return db.rev, db.round, nil
}

// end ends the call begin marked, the value in round at rev (0: out).
func (db *DoubleBarrier) end(rev, round int64) {
	db.mu.Lock()
	defer db.mu.Unlock()
	db.busy, db.rev, db.round = false, rev, round
}

// why is the error of op that failed with err: ctx's error, or the
// session's, when one of them ended the call; err itself when it names the
// barrier already (a sentinel's); else err with what failed.
func (db *DoubleBarrier) why(op string, ctx context.Context, err error) error {
	s := db.sl.Session()
	switch {
	case ctx.Err() != nil:
		err = ctx.Err()
	case s.Ctx().Err() != nil:
		return s.EndedErr()
	case errors.Is(err, ErrLocked) || errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrSessionExpired):
		return err
	}
	return fmt.Errorf("etcdsync: %s double barrier %s: %w", op, db.sl.Name(), err)
}

// gone is the error of a party whose key vanished by revision rev.
func (db *DoubleBarrier) gone(rev int64) error {
	return fmt.Errorf("%w (double barrier party %s, by revision %d)", queue.ErrOwnKeyGone, db.sl.Key(), rev)
}

// enter reserves the party's key in the session and joins the round; on
// error it removes the key it may have written and frees the reservation.
func (db *DoubleBarrier) enter(ctx context.Context) (rev, round int64, err error) {
	sl := &db.sl
	s := sl.Session()
	if err := ctx.Err(); err != nil { // nothing is sent
		return 0, 0, db.why("enter", ctx, err)
	}
	if s.Err() != nil {
		return 0, 0, s.EndedErr()
	}
	if err := sl.Reserve(ctx); err != nil {
		return 0, 0, fmt.Errorf("%w: double barrier %s: this session is a party already, through another value (a Session is one party)", ErrInvalidArgument, sl.Name())
	}
	wctx, cancel := s.Bound(ctx)
	defer cancel()
	rev, round, wrote, err := db.join(wctx)
	if err == nil {
		return rev, round, nil // the reservation is kept until Leave
	}
	err = db.why("enter", ctx, err)
	switch {
	case s.Err() != nil: // the key goes with the lease
	case wrote && rev == 0: // the create's outcome is unknown
		sl.Sweep()
	case wrote:
		err = queue.WithCleanup(err, sl.Withdraw(rev))
	}
	sl.Unreserve()
	return 0, 0, err
}

// join writes the party's key if absent and reads ready and the first
// count parties, in one transaction, then comes out with the round's
// revision: at once when the round filled after the key's create (a
// retried or resumed Enter), by putting ready when the key makes count,
// else by waiting for that put. It returns the key's create revision, and
// whether the key may be there for the caller to remove (rev 0: the
// create's outcome is unknown). The create runs on for createGrace after
// ctx ends (see graced), so that its outcome is nearly always known.
func (db *DoubleBarrier) join(ctx context.Context) (rev, round int64, wrote bool, err error) {
	sl := &db.sl
	list := clientv3.OpGet(db.waiters, clientv3.WithPrefix(), clientv3.WithKeysOnly(),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend), clientv3.WithLimit(int64(db.count)))
	cctx, cancel := graced(ctx)
	defer cancel()
	resp, err := sl.Session().Client().Txn(cctx).
		If(clientv3.Compare(clientv3.CreateRevision(sl.Key()), "=", 0)).
		Then(clientv3.OpPut(sl.Key(), "", clientv3.WithLease(sl.Session().Lease())), clientv3.OpGet(db.ready), list).
		Else(clientv3.OpGet(sl.Key()), clientv3.OpGet(db.ready), list).
		Commit()
	if err != nil {
		return 0, 0, queue.Unsure(err), err
	}
	rev = resp.Header.Revision
	if own := resp.Responses[0].GetResponseRange().GetKvs(); len(own) > 0 {
		if clientv3.LeaseID(own[0].Lease) != sl.Session().Lease() {
			return 0, 0, false, fmt.Errorf("%w: key %s exists with lease %x, not this session's %x", ErrInvalidArgument, sl.Key(), own[0].Lease, int64(sl.Session().Lease()))
		}
		rev = own[0].CreateRevision
	}
	if err := ctx.Err(); err != nil {
		return rev, 0, true, err
	}
	ready := resp.Responses[1].GetResponseRange().GetKvs()
	kvs := resp.Responses[2].GetResponseRange().GetKvs() // ours or count others: never empty
	switch {
	case len(ready) > 0 && ready[0].ModRevision > rev:
		return rev, ready[0].ModRevision, true, nil
	case len(ready) > 0 && kvs[0].CreateRevision < ready[0].ModRevision:
		// A party older than ready is still in: its round is under way.
		// (A ready with no such party is a round's whose last parties
		// crashed: it is ignored, and the next put replaces it.)
		return rev, 0, true, fmt.Errorf("%w: double barrier %s: a round is under way (it filled at revision %d; its parties have not all left)", ErrLocked, sl.Name(), ready[0].ModRevision)
	}
	switch i := slices.IndexFunc(kvs, func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == sl.Key() }); {
	case i < 0:
		return rev, 0, true, fmt.Errorf("%w: double barrier %s is full: %d parties entered before this one", ErrLocked, sl.Name(), db.count)
	case i == db.count-1:
		round, err = db.fill(ctx, rev, kvs)
	default:
		round, err = db.await(ctx, rev, resp.Header.Revision+1)
	}
	return rev, round, !errors.Is(err, queue.ErrOwnKeyGone), err
}

// fill puts ready, while the party's key (created at rev) and every party
// it counted (counted, its own included) are there, and only if ready was
// not put since: a retry finds its own put. It returns the put's revision.
// When a counted party went meanwhile, the round is not full: it waits for
// the put of the party that fills it (await). RPC errors are retried until
// ctx ends.
func (db *DoubleBarrier) fill(ctx context.Context, rev int64, counted []*mvccpb.KeyValue) (int64, error) {
	key := db.sl.Key()
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", rev), clientv3.Compare(clientv3.ModRevision(db.ready), "<", rev)}
	for _, kv := range counted {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(string(kv.Key)), "=", kv.CreateRevision))
	}
	for {
		resp, err := db.sl.Session().Client().Txn(ctx).
			If(cmps...).
			Then(clientv3.OpPut(db.ready, "")).
			Else(clientv3.OpGet(key), clientv3.OpGet(db.ready)).
			Commit()
		switch {
		case err == nil && resp.Succeeded:
			return resp.Header.Revision, nil
		case err == nil:
			round, err := db.filled(resp, rev)
			if err == nil && round == 0 { // a counted party went: not full yet
				return db.await(ctx, rev, resp.Header.Revision+1)
			}
			return round, err
		case ctx.Err() != nil:
			return 0, ctx.Err()
		}
		if err := queue.Pause(ctx); err != nil {
			return 0, err
		}
	}
}

// await waits, watching from revision from, for the put of ready after
// rev (the create revision of the party's key) and returns its revision;
// or for the delete of the party's key (an error wrapping
// ErrSessionExpired). A failed watch is followed by one read of the two
// keys, then a watch from that read. It returns ctx's error when ctx ends.
func (db *DoubleBarrier) await(ctx context.Context, rev, from int64) (int64, error) {
	key := db.sl.Key()
	for {
		ev, err := watchFor(ctx, db.sl.Session().Client(), from, db.ready, mvccpb.PUT, key)
		switch {
		case err == nil && string(ev.Kv.Key) == key:
			return 0, db.gone(ev.Kv.ModRevision)
		case err == nil:
			return ev.Kv.ModRevision, nil
		case ctx.Err() != nil:
			return 0, ctx.Err()
		}
		if err := queue.Pause(ctx); err != nil {
			return 0, err
		}
		resp, err := db.sl.Session().Client().Txn(ctx).Then(clientv3.OpGet(key), clientv3.OpGet(db.ready)).Commit()
		if err != nil {
			continue
		}
		round, err := db.filled(resp, rev)
		if err != nil || round > 0 {
			return round, err
		}
		from = resp.Header.Revision + 1
	}
}

// filled reads a response of two Gets, the party's key (created at rev)
// and ready: the revision of ready's put when it came after rev, 0 when it
// has not come yet, an error wrapping ErrSessionExpired when the key is
// gone.
func (db *DoubleBarrier) filled(resp *clientv3.TxnResponse, rev int64) (int64, error) {
	own := resp.Responses[0].GetResponseRange().GetKvs()
	ready := resp.Responses[1].GetResponseRange().GetKvs()
	switch {
	case len(own) == 0 || own[0].CreateRevision != rev:
		return 0, db.gone(resp.Header.Revision)
	case len(ready) > 0 && ready[0].ModRevision > rev:
		return ready[0].ModRevision, nil
	}
	return 0, nil
}

// watchFor watches key for an event of type typ and own (unless "") for
// its delete, both from revision from, on one watch stream, and returns the
// first such event; matched to its key by the channel it came on. It
// returns an error when ctx ends or a watch fails (a broken stream, a
// compaction, a lost leader): the caller reads again.
func watchFor(ctx context.Context, cli *clientv3.Client, from int64, key string, typ mvccpb.Event_EventType, own string) (*clientv3.Event, error) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	keys := cli.Watch(ctx, key, clientv3.WithRev(from))
	var owns clientv3.WatchChan // nil: never ready
	if own != "" {
		owns = cli.Watch(ctx, own, clientv3.WithRev(from), clientv3.WithFilterPut())
	}
	for {
		var wr clientv3.WatchResponse
		var ok, mine bool
		select {
		case wr, ok = <-keys:
		case wr, ok = <-owns:
			mine = true
		}
		switch {
		case !ok && ctx.Err() != nil:
			return nil, ctx.Err()
		case !ok:
			return nil, errors.New("etcdsync: watch ended")
		case wr.Canceled:
			return nil, fmt.Errorf("etcdsync: watch canceled: %w", wr.Err())
		}
		for _, ev := range wr.Events {
			if mine || ev.Type == typ {
				return ev, nil
			}
		}
	}
}

// leave runs the Leave order for the party's key created at rev in the
// round that filled at round. On error it removes the key, if it is still
// there and the session lives.
func (db *DoubleBarrier) leave(ctx context.Context, rev, round int64) error {
	s := db.sl.Session()
	if s.Err() != nil {
		return s.EndedErr()
	}
	wctx, cancel := s.Bound(ctx)
	defer cancel()
	l := leaving{db: db, rev: rev, round: round}
	err := l.run(wctx)
	if err == nil {
		return nil
	}
	err = db.why("leave", ctx, err)
	if !l.left && s.Err() == nil && !errors.Is(err, queue.ErrOwnKeyGone) {
		err = errors.Join(err, db.withdraw(rev, round, l.alone))
	}
	return err
}

// depart deletes the party's key, created at rev, and, when last, ready
// too if it is still the round's put. It reports false when the key was
// gone already.
func (db *DoubleBarrier) depart(ctx context.Context, rev, round int64, last bool) (ok bool, at int64, err error) {
	ops := []clientv3.Op{clientv3.OpDelete(db.sl.Key())}
	if last {
		ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(db.ready), "=", round)},
			[]clientv3.Op{clientv3.OpDelete(db.ready)}, nil))
	}
	resp, err := db.sl.Session().Client().Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(db.sl.Key()), "=", rev)).Then(ops...).Commit()
	if err != nil {
		return false, 0, err
	}
	return resp.Succeeded, resp.Header.Revision, nil
}

// withdraw removes the key of a party whose Leave failed, and ready with it
// when it was the round's last party, under a short context of its own (see
// Slot.Withdraw, which the session's sweeper backs).
func (db *DoubleBarrier) withdraw(rev, round int64, last bool) error {
	if last {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(db.sl.Session().Ctx()), queue.CreateGrace)
		_, _, err := db.depart(ctx, rev, round, true)
		cancel()
		if err == nil {
			return nil
		}
	}
	return db.sl.Withdraw(rev)
}
