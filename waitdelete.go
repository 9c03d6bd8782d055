package etcdsync

// The acquire step and the wait loop that every primitive shares.
//
// A contender writes one key NAME/<lease-hex>, bound to its session's lease,
// in one create-if-absent transaction that also lists, keys only and sorted by
// create revision, the keys under NAME/. The direct children of NAME/ form a
// queue in create-revision order; the oldest holds. A waiter watches its own
// key and the two nearest older keys (its predecessor and the one before it)
// through the client's Watcher, on one watch stream of its own. Older keys
// can only vanish, never appear, so when the last older key goes the waiter
// owns the turn with no further RPC (a progress request on its stream shows
// its own key still there; where the server's answers cannot be trusted or
// do not come, one read does: see caps); when its own key goes first it
// returns ErrSessionExpired. Every request goes through the client's
// interfaces (KV, Watcher, Lease, Maintenance), so that a namespace, a
// wrapper, an in-process client or etcd's gRPC proxy sees it.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// checkName validates a primitive's name.
func checkName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty name", ErrInvalidName)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return fmt.Errorf("%w: name %q has a NUL byte", ErrInvalidName, name)
	}
	return nil
}

// slot is one contender's place: the session, the name's prefix, the key,
// and the rule that says whom it waits for.
type slot struct {
	s      *Session
	prefix string // NAME/
	key    string // NAME/<lease-hex>, or NAME/read/<lease-hex> and so on (rule.dir)
	kind   string // of primitive: mutex, election, rwmutex, semaphore
	rule   *rule
}

// rule says whom a contender waits for: which of the keys under its prefix
// created before its own block it, their weights, and how much blocking
// weight may remain ahead when it holds.
type rule struct {
	dir    string // our key's directory under the prefix: "" (NAME/<hex>), "read/", "write/"
	blocks func(prefix string, kv *mvccpb.KeyValue) bool
	weigh  func(kv *mvccpb.KeyValue) (int64, error) // a blocking key's weight (its value is read); nil: 1 each, keys only
	room   int64                                    // blocking weight that may remain ahead
	free   string                                   // under the prefix: what must be empty for a try to write at once
	shared bool                                     // holds of one session share the key (counted)
	// exact: watch only the keys that keep us out, not also the one behind
	// them, so that a release reaches only waiters it may let in; a waiter
	// whose nearest key goes while older ones were listed then reads once.
	exact bool
}

// exclusive is the rule of a Mutex or an Election: every direct child of the
// prefix created before ours blocks, and none may remain.
var exclusive = rule{blocks: func(prefix string, kv *mvccpb.KeyValue) bool { return isChild(prefix, string(kv.Key)) }}

// blocking returns the keys of kvs (sorted by create revision) created before
// rev that block, oldest first. A key whose weight the rule cannot read is an
// error wrapping ErrInvalidArgument.
func (sl *slot) blocking(kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
	var out []*mvccpb.KeyValue
	for _, kv := range kvs {
		if kv.CreateRevision < rev && sl.rule.blocks(sl.prefix, kv) {
			if sl.rule.weigh != nil {
				if _, err := sl.rule.weigh(kv); err != nil {
					return nil, err
				}
			}
			out = append(out, kv)
		}
	}
	return out, nil
}

// weight is the total weight of kvs, blocking keys that blocking accepted.
// It saturates at math.MaxInt64.
func (r *rule) weight(kvs []*mvccpb.KeyValue) int64 {
	if r.weigh == nil {
		return int64(len(kvs))
	}
	var w int64
	for _, kv := range kvs {
		n, _ := r.weigh(kv)
		w = addWeights(w, n)
	}
	return w
}

// addWeights adds two weights (≥ 0), saturating at math.MaxInt64.
func addWeights(a, b int64) int64 {
	if b > math.MaxInt64-a {
		return math.MaxInt64
	}
	return a + b
}

// nearest returns the keys ahead a waiter watches: the nearest ones whose
// weight exceeds the room (the turn cannot come before one of them goes),
// and, unless the rule is exact, the one behind them.
func (t *turn) nearest() []*mvccpb.KeyValue {
	i, w := len(t.ahead), int64(0)
	for i > 0 && w <= t.rule.room {
		i--
		w = addWeights(w, t.rule.weight(t.ahead[i:i+1]))
	}
	if t.rule.exact {
		return t.ahead[i:]
	}
	return t.ahead[max(0, i-1):]
}

// name is the primitive's name: the prefix without its slash.
func (sl *slot) name() string { return strings.TrimSuffix(sl.prefix, "/") }

func newSlot(s *Session, name, kind string) (slot, error) {
	if s == nil {
		return slot{}, fmt.Errorf("%w: nil session", ErrInvalidArgument)
	}
	if err := checkName(name); err != nil {
		return slot{}, err
	}
	return slot{s: s, prefix: name + "/", kind: kind}.with(&exclusive), nil
}

// with returns the slot under rule r, its key in r's directory.
func (sl slot) with(r *rule) slot {
	sl.rule, sl.key = r, fmt.Sprintf("%s%s%x", sl.prefix, r.dir, int64(sl.s.Lease()))
	return sl
}

// isChild reports whether key is a direct child NAME/<hex> of prefix: the
// only keys that take part in a queue (a lock on NAME/x never blocks NAME).
func isChild(prefix, key string) bool {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok || rest == "" {
		return false
	}
	for i := 0; i < len(rest); i++ {
		if c := rest[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// listOp lists the keys under the prefix in create-revision order, with
// their values only when the rule weighs them.
func (sl *slot) listOp() clientv3.Op {
	return clientv3.OpGet(sl.prefix, sl.listOpts()...)
}

func (sl *slot) listOpts() []clientv3.OpOption {
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	if sl.rule.weigh == nil {
		opts = append(opts, clientv3.WithKeysOnly())
	}
	return opts
}

// turn is the outcome of an acquire: our key's create revision, the keys
// ahead of it and the header of the read that listed them.
type turn struct {
	*slot
	rev   int64
	value []byte // our key's value when it already existed (non-nil), else nil
	ahead []*mvccpb.KeyValue
	hdr   *pb.ResponseHeader
	wrote bool // this call may have written the key
	// gone is the latest delete of a key listed ahead seen since: one
	// stream delivers the deletes of different watches out of revision
	// order (a watch's events wait until the server has sent its creation),
	// and the turn comes no earlier than the latest.
	gone int64
}

// enqueue writes our key if absent and reads the queue, in one transaction.
// A key that already exists with our lease is ours: a resumed hold after a
// restart with WithLease, or a create the client retried after it committed.
func (sl *slot) enqueue(ctx context.Context, val string) (turn, error) {
	lease := sl.s.Lease()
	list := sl.listOp()
	resp, err := sl.s.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(sl.key), "=", 0)).
		Then(clientv3.OpPut(sl.key, val, clientv3.WithLease(lease)), list).
		Else(clientv3.OpGet(sl.key), list).
		Commit()
	if err != nil {
		return turn{slot: sl, wrote: unsure(err)}, err
	}
	t := turn{slot: sl, hdr: resp.Header, wrote: resp.Succeeded, rev: resp.Header.Revision}
	err = t.queued(resp, val)
	return t, err
}

// queued fills t from an enqueue's response: our key as it already was, if
// the response has it (it must have our lease and, under a rule that weighs
// keys, the value val asks for), and the keys ahead of it (t.rev: our key's
// create revision if it is new).
func (t *turn) queued(resp *clientv3.TxnResponse, val string) error {
	var own *mvccpb.KeyValue
	if kvs := resp.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 { // none after a put
		own = kvs[0]
		if lease := t.s.Lease(); clientv3.LeaseID(own.Lease) != lease {
			return fmt.Errorf("%w: key %s exists with lease %x, not this session's %x", ErrInvalidArgument, t.key, own.Lease, int64(lease))
		}
		if t.rule.weigh != nil && string(own.Value) != val { // a restarted process's key, resumed
			return fmt.Errorf("%w: key %s exists with %q, and this call asks for %q: acquire it as it is, then release it", ErrInvalidArgument, t.key, own.Value, val)
		}
		t.rev, t.value = own.CreateRevision, append([]byte{}, own.Value...)
	}
	var err error
	if t.ahead, err = t.blocking(resp.Responses[1].GetResponseRange().Kvs, t.rev); err != nil {
		return err
	}
	if own != nil {
		t.wrote = t.mine(own) // after t.ahead: a waiting key is ours to withdraw
	}
	return nil
}

// mine reports whether a key of ours that existed before this call is this
// call's to withdraw if it fails: one this session made (a create applied
// late), or a restarted process's key (WithLease) that still waits; never a
// restarted process's hold.
func (t *turn) mine(kv *mvccpb.KeyValue) bool {
	return t.s.made(kv) || t.blocked()
}

// tryEnqueue writes our key only if nothing at all is under NAME/ (under
// NAME/<rule.free>): one RPC and no write when the name is held. When the
// compare fails although nothing blocks us (only nested keys NAME/x/…, or
// keys that leave us room), it falls back to enqueue. The returned turn has
// keys ahead when the name is held; the caller then withdraws the key if it
// wrote one.
func (sl *slot) tryEnqueue(ctx context.Context, val string) (turn, error) {
	lease := sl.s.Lease()
	resp, err := sl.s.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(sl.prefix+sl.rule.free), "=", 0).WithPrefix(),
			clientv3.Compare(clientv3.CreateRevision(sl.key), "=", 0)). // ours may lie outside rule.free
		Then(clientv3.OpPut(sl.key, val, clientv3.WithLease(lease))).
		Else(clientv3.OpGet(sl.key), sl.listOp()).
		Commit()
	if err != nil {
		return turn{slot: sl, wrote: unsure(err)}, err
	}
	if resp.Succeeded {
		return turn{slot: sl, hdr: resp.Header, wrote: true, rev: resp.Header.Revision}, nil
	}
	// Without a key of ours, every direct child is ahead of where ours would be.
	t := turn{slot: sl, hdr: resp.Header, rev: resp.Header.Revision + 1}
	if err := t.queued(resp, val); err != nil {
		return t, err
	}
	if !t.blocked() && t.value == nil {
		return sl.enqueue(ctx, val)
	}
	return t, nil
}

// withdraw deletes the key this call may have written: the one at rev, or
// (rev 0: the create's outcome is unknown) the key with our lease created
// after the session began that a read finds, at its create revision; never a
// hold that a restarted process resumes (WithLease), and, however late the
// server applies it, never a later hold. When it fails the session sweeps
// the key (see Session.sweep). It runs under a short bounded context of its
// own, as it cleans up after calls whose context may have ended.
func (sl *slot) withdraw(rev int64) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sl.s.ctx), createGrace)
	defer cancel()
	err := sl.deleteAt(ctx, rev)
	if err != nil {
		sl.s.disown(sl.key, rev) // before the key's claim is freed: the sweeper acts
		sl.s.sweep(sl.key)
		return fmt.Errorf("etcdsync: remove %s after a failed acquire: %w", sl.key, err)
	}
	return nil
}

// deleteAt deletes our key at create revision rev; with rev 0, the key with
// our lease created after the session began, if any.
func (sl *slot) deleteAt(ctx context.Context, rev int64) error {
	if rev == 0 {
		resp, err := sl.s.client.Get(ctx, sl.key)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 || !sl.s.made(resp.Kvs[0]) {
			return nil
		}
		rev = resp.Kvs[0].CreateRevision
	}
	return deleteAtRev(ctx, sl.s.client, sl.key, rev)
}

// deleteAtRev deletes key only while it is the incarnation created at rev, so
// that however late the server applies it, it never deletes a later one.
func deleteAtRev(ctx context.Context, cli *clientv3.Client, key string, rev int64) error {
	_, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", rev)).
		Then(clientv3.OpDelete(key)).Commit()
	return err
}

// blocked reports whether more weight that blocks us is listed ahead than
// the rule leaves room for.
func (t *turn) blocked() bool { return t.rule.weight(t.ahead) > t.rule.room }

// final reports whether a wait that failed with err must not retry: our key
// is gone, or a key ahead breaks the rule (another capacity, say).
func final(err error) bool {
	return errors.Is(err, ErrSessionExpired) || errors.Is(err, ErrInvalidArgument)
}

// wait blocks until the keys ahead of ours no longer block it (see rule),
// then returns the header of the revision at which the turn came. It returns ErrSessionExpired (wrapped) as
// soon as our own key vanishes, and ctx's error when ctx ends; it leaves the
// key in place either way (the caller withdraws it).
func (t *turn) wait(ctx context.Context) (*pb.ResponseHeader, error) {
	for t.blocked() {
		err := t.watch(ctx)
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case final(err):
			return nil, err
		default:
			// The stream broke (member restart, lost leader, compaction):
			// re-read where we stand and watch again.
			if err := sleep(ctx, retryPause); err != nil {
				return nil, err
			}
			if err := t.settle(ctx, t.hdr.Revision); err != nil && final(err) {
				return nil, err
			}
		}
	}
	return t.hdr, nil
}

// progressWait bounds the wait for the answer to a progress request. etcd's
// gRPC proxy never answers one, and a member answers only once every watch
// on the stream is synced; unanswered, the waiter reads instead, and the
// client is marked as one whose progress requests go unanswered (see caps).
// A client learns that off the critical path: the first waits on it send a
// probe as soon as they watch, and one that waits progressWait learns the
// answer before its turn comes; a turn that comes sooner waits for the
// probe's answer no longer than the probe's own progressWait.
const progressWait = 500 * time.Millisecond

// keyed is one response of the watch of one key, or (closed) the end of it.
type keyed struct {
	key    string
	wr     clientv3.WatchResponse
	closed bool
}

// stream is a waiter's watches: one of its own key and one of each of the
// nearest keys that block it, all through the client's Watcher, from the
// serving member's current revision, on one gRPC stream of the wait's own
// (see waitContext).
// A response is matched to its key by the channel it came on, never by a
// watch ID. The stream's goroutines (one per watch, each forwarding its
// channel to in) are owned by the wait and joined by close.
type stream struct {
	t    *turn
	ctx  context.Context
	in   chan keyed
	own  context.CancelFunc
	keys map[string]context.CancelFunc // key ahead -> ends its watch
	wg   sync.WaitGroup
	// ownSeen is set once the watch of our own key has shown its creation:
	// a progress answer on it counts only from then on.
	ownSeen bool
	trust   bool // progress answers may confirm the turn (see caps)
	// probe fires when the probe (see caps.probing), a progress request sent
	// once our own key's watch was created, has gone unanswered for
	// progressWait; nil when none is out. probeEnd is when it fires.
	probe     <-chan time.Time
	probeEnd  time.Time
	stopTimer func() bool
}

// waitSeq numbers waits, so that each has a stream of its own (waitContext).
var waitSeq atomic.Uint64

// waitContext marks the watches and progress requests of one wait with
// metadata of their own, so that the client's Watcher (which groups watches
// on gRPC streams by their contexts' outgoing metadata) puts them on a
// stream of their own: a progress request then concerns, and its answer
// reaches, this waiter's watches only, at any queue length.
func waitContext(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(clientv3.WithRequireLeader(ctx), "etcdsync-wait", strconv.FormatUint(waitSeq.Add(1), 36))
}

// add starts the watch of key's deletes from the current revision. It
// blocks until the watch is created (the client's Watcher creates the
// watches of a stream one at a time, in order), or its context ends.
func (st *stream) add(key string) context.CancelFunc {
	ctx, cancel := context.WithCancel(st.ctx)
	ch := st.t.s.client.Watch(ctx, key, clientv3.WithFilterPut(), clientv3.WithCreatedNotify())
	st.wg.Add(1)
	go func() {
		defer st.wg.Done()
		for wr := range ch {
			select {
			case st.in <- keyed{key: key, wr: wr}:
			case <-ctx.Done():
				return
			}
		}
		select {
		case st.in <- keyed{key: key, closed: true}:
		case <-ctx.Done():
		}
	}()
	return cancel
}

// close ends every watch and waits for their goroutines.
func (st *stream) close() {
	st.own()
	for _, cancel := range st.keys {
		cancel()
	}
	st.wg.Wait()
}

// watch watches our key and the nearest keys ahead and waits. It returns
// nil when the turn came (nothing blocks us), an error wrapping
// ErrSessionExpired when our key went, or another error when a watch
// failed.
//
// It watches our own key and the nearest keys that block us (turn.nearest):
// the nearest ones whose weight exceeds the rule's room, as the turn cannot
// come before one of them goes, and the one behind them too, so that when it
// goes first (while the nearest still block us) the waiter learns, off the
// critical path, what is left ahead: by a read when keys it does not watch
// were listed, else at once. When the turn then comes, the list is exact and
// needs no read. All watches start at the serving member's current revision
// (start 0), so the server puts them in its synced set at once (a watch from
// a past revision waits up to 100 ms for the server's resync). Two things
// follow:
//
//   - The member may be ahead of our last read (t.hdr): writes between the read
//     and a watch's creation leave a gap, which one read at the created
//     revision closes.
//   - The member may lag behind our last read (a follower cut off from its
//     peers for a moment still serves watches): the stream then replays events
//     up to our read, such as the delete of an older incarnation of a key we
//     watch (same session, unlocked and locked again). A delete at or below the
//     revision of the read that saw the key present cannot be that key's
//     delete, so every event at or below t.hdr.Revision is ignored.
//
// Handoff: when a watched key's delete leaves no more blocking keys listed
// than the rule allows (older keys can only vanish, never appear), the turn
// is ours at R, the latest delete of a listed key seen (the watches' channels
// deliver the deletes of different keys in no set order), unless our own key
// went by R (one transaction deleting a whole prefix). A progress request
// settles it: the server answers it, on every watch of the stream, after
// every event up to its current revision (at least R) has gone out. Where
// the server's answer cannot be trusted or does not come (see caps), one
// read at R or later settles it instead. When more keys are listed and all
// of them are watched, they all still block us (their deletes have not
// arrived); when some are not watched, one read says which are gone.
func (t *turn) watch(ctx context.Context) error {
	st := &stream{t: t, ctx: waitContext(ctx), in: make(chan keyed), keys: make(map[string]context.CancelFunc)}
	st.trust = capsOf(t.s.client).progress(ctx, t.s.client) // before the watches: a gap it leaves is read
	st.own = st.add(t.key)
	defer st.close()
	defer st.stopProbe()
	for t.blocked() {
		st.watchNearest()
		key, gone, err := st.next(ctx)
		switch {
		case err != nil:
			return err
		case gone == 0: // a read moved the queue: watch the new nearest keys
		default:
			// The list changes only once the turn is confirmed or a read
			// says what is left: a watch that fails meanwhile leaves us
			// as blocked as before.
			rest := slices.DeleteFunc(slices.Clone(t.ahead), func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == key })
			t.gone = max(t.gone, gone)
			switch {
			case t.rule.weight(rest) <= t.rule.room:
				err = st.confirm(ctx, t.gone)
			case st.watchesAll(rest):
				t.ahead = rest // still blocked: nothing to undo if a watch fails
			default:
				err = t.settle(ctx, gone)
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// watchNearest makes the stream watch the nearest keys that block us (see
// turn.nearest), and only those.
func (st *stream) watchNearest() {
	near := st.t.nearest()
	for key, cancel := range st.keys {
		if !slices.ContainsFunc(near, func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == key }) {
			cancel()
			delete(st.keys, key)
		}
	}
	for _, kv := range near {
		if _, ok := st.keys[string(kv.Key)]; !ok {
			st.keys[string(kv.Key)] = st.add(string(kv.Key))
		}
	}
}

// watchesAll reports whether the stream watches every key of kvs.
func (st *stream) watchesAll(kvs []*mvccpb.KeyValue) bool {
	for _, kv := range kvs {
		if _, ok := st.keys[string(kv.Key)]; !ok {
			return false
		}
	}
	return true
}

// next reads the watches until a watched key ahead is deleted (after our
// last read), and returns it with the delete's revision; or until a watch's
// creation past our last read made us read again (the queue may have moved),
// and returns a revision of 0. A delete of our own key is an error wrapping
// ErrSessionExpired.
func (st *stream) next(ctx context.Context) (string, int64, error) {
	t := st.t
	for {
		r, err := st.recv(ctx)
		if err != nil {
			return "", 0, err
		}
		if r.wr.Created && r.wr.Header.Revision > t.hdr.Revision {
			return "", 0, t.settle(ctx, r.wr.Header.Revision)
		}
		if _, ok := st.keys[r.key]; ok {
			if rev := t.deleted(r.wr); rev > 0 {
				return r.key, rev, nil
			}
		}
	}
}

// confirm makes the turn ours at rev, the latest delete of a key ahead
// seen, once our own key's watch shows that it was not deleted by then: it
// asks for progress and waits for the answer on that watch. Where progress
// answers cannot be trusted, or the answer does not come within
// progressWait (the client is then marked, see caps), it reads instead.
func (st *stream) confirm(ctx context.Context, rev int64) error {
	t := st.t
	c := capsOf(t.s.client)
	if !st.trust || c.state.Load() != capsProgress || t.s.client.RequestProgress(st.ctx) != nil {
		return t.settle(ctx, rev)
	}
	wait := progressWait
	if st.probe != nil { // the probe is out: its answer would have come by its end
		wait = max(0, time.Until(st.probeEnd))
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		var r keyed
		select {
		case r = <-st.in:
		case <-timer.C:
			c.unanswered()
			return t.settle(ctx, rev)
		case <-ctx.Done():
			return ctx.Err()
		}
		if err := st.check(r); err != nil {
			return err
		}
		switch {
		case r.key != t.key:
		case r.wr.Created && r.wr.Header.Revision > t.hdr.Revision:
			// Our key's watch began after our last read: the gap
			// is read.
			return t.settle(ctx, max(rev, r.wr.Header.Revision))
		case st.ownSeen && r.wr.IsProgressNotify():
			if r.wr.Header.Revision < rev { // a member behind the delete (after a reconnect): wait on
				continue
			}
			t.ahead = nil
			h := r.wr.Header
			t.hdr = &pb.ResponseHeader{ClusterId: h.ClusterId, MemberId: h.MemberId, Revision: rev, RaftTerm: h.RaftTerm}
			return nil
		}
	}
}

// recv returns the next response of a watch. A delete of our own key
// (after our last read) is an error wrapping ErrSessionExpired; a failed
// watch of our own key or of a key we wait for is an error.
func (st *stream) recv(ctx context.Context) (keyed, error) {
	for {
		select {
		case r := <-st.in:
			return r, st.check(r)
		case <-st.probe:
			st.probe = nil
			capsOf(st.t.s.client).unanswered()
		case <-ctx.Done():
			return keyed{}, ctx.Err()
		}
	}
}

// sendProbe sends the probe (see caps.probing), once our own key's watch
// was created, if the client wants one. Its answer is noted by check; its
// silence by recv, once progressWait has passed.
func (st *stream) sendProbe() {
	if !capsOf(st.t.s.client).probing() || st.t.s.client.RequestProgress(st.ctx) != nil {
		return
	}
	timer := time.NewTimer(progressWait)
	st.probe, st.probeEnd, st.stopTimer = timer.C, time.Now().Add(progressWait), timer.Stop
}

// stopProbe stops the probe's timer, if one is out.
func (st *stream) stopProbe() {
	if st.probe != nil {
		st.stopTimer()
		st.probe = nil
	}
}

// check returns the error r means, if any (see recv), and notes the
// creation of our own key's watch (then sends the probe) and the answers to
// progress requests on it.
func (st *stream) check(r keyed) error {
	_, watched := st.keys[r.key]
	mine := r.key == st.t.key
	switch {
	case !watched && !mine: // a watch dropped since
		return nil
	case r.closed:
		return fmt.Errorf("etcdsync: watch of %s ended", r.key)
	case r.wr.Canceled || r.wr.Err() != nil:
		return fmt.Errorf("etcdsync: watch of %s canceled: %w", r.key, r.wr.Err())
	case !mine:
		return nil
	case r.wr.Created:
		st.ownSeen = true
		st.sendProbe()
	case st.ownSeen && r.wr.IsProgressNotify():
		st.stopProbe()
		capsOf(st.t.s.client).answer()
	}
	if rev := st.t.deleted(r.wr); rev > 0 {
		return fmt.Errorf("%w (revision %d)", errOwnKeyGone, rev)
	}
	return nil
}

// deleted returns the revision of a delete that wr reports after our last
// read, else 0.
func (t *turn) deleted(wr clientv3.WatchResponse) int64 {
	for _, ev := range wr.Events {
		if ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > t.hdr.Revision {
			return ev.Kv.ModRevision
		}
	}
	return 0
}

// settle re-reads the keys up to ours at a revision of at least atLeast and
// of the latest delete seen, and updates t: serializable when the answer is
// that recent (its header's revision is checked: a cached answer, such as
// etcd's gRPC proxy gives, is a true state at its revision, and when that
// is too old it does not count), else linearizable; linearizable at once on
// a client whose serializable reads come from that cache (caps.cached). It returns an error wrapping ErrSessionExpired when our key is gone.
func (t *turn) settle(ctx context.Context, atLeast int64) error {
	atLeast = max(atLeast, t.gone) // a list from before a delete seen would wait for it again
	opts := append(t.listOpts(), clientv3.WithMaxCreateRev(t.rev))
	var resp *clientv3.GetResponse
	var err error
	if !capsOf(t.s.client).cached() {
		resp, err = t.s.client.Get(ctx, t.prefix, append(opts, clientv3.WithSerializable())...)
	}
	if resp == nil && err == nil || err == nil && resp.Header.Revision < atLeast {
		resp, err = t.s.client.Get(ctx, t.prefix, opts...)
	}
	if err != nil {
		return err
	}
	mine := false
	for _, kv := range resp.Kvs {
		mine = mine || string(kv.Key) == t.key && kv.CreateRevision == t.rev
	}
	if !mine {
		return errOwnKeyGone
	}
	ahead, err := t.blocking(resp.Kvs, t.rev)
	if err != nil {
		return err
	}
	t.ahead, t.hdr = ahead, resp.Header
	return nil
}

func sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}

// mode says how acquire waits.
type mode int

const (
	waitTurn mode = iota // wait in the queue (Lock, Campaign)
	tryTurn              // never wait (TryLock)
)

// createGrace is how long an acquire's create may run on after the caller's
// context (or the session) ended: long enough to learn, in most cases, whether
// it committed, so that the cleanup knows what to delete.
const createGrace = time.Second

// acquire takes the slot's key for one hold: it reserves the key in the
// session, enqueues, and (in waitTurn mode) waits for its turn. ctx bounds it
// all; the session's end also ends it. A ctx that has ended sends nothing. On
// error no key of this call is left behind: the cleanup runs under a short
// bounded context of its own, and a key it cannot remove, or a create whose
// outcome stays unknown, is swept by the session, however late the server
// applies it. Past ctx's end it blocks at most createGrace for the create and
// as long again for the cleanup. The reservation is freed. In tryTurn mode a held
// name gives an error wrapping ErrLocked. A hold is returned only while the
// session lives. Under a shared rule, a live hold of the key in the session
// is joined (counted) without touching etcd.
func (sl *slot) acquire(ctx context.Context, val string, m mode) (*hold, []byte, error) {
	if !sl.s.rep.on() {
		return sl.take(ctx, val, m)
	}
	began := time.Now()
	h, value, err := sl.take(ctx, val, m)
	sl.acquired(h, err, time.Since(began))
	return h, value, err
}

// take is acquire, unreported.
func (sl *slot) take(ctx context.Context, val string, m mode) (*hold, []byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, sl.why(ctx, err)
	}
	if err := sl.s.Err(); err != nil {
		return nil, nil, sl.s.endedErr()
	}
	if sl.rule.shared {
		if h, err := sl.s.shareKey(ctx, sl.key, m == waitTurn); err != nil || h != nil {
			return h, nil, err
		}
	} else if err := sl.s.claimKey(ctx, sl.key, m == waitTurn); err != nil {
		return nil, nil, err
	}
	if err := ctx.Err(); err != nil { // it ended as the key was freed
		sl.s.releaseKey(sl.key)
		return nil, nil, sl.why(ctx, err)
	}
	wctx, cancel := sl.s.bound(ctx)
	defer cancel()

	// The create is not cancelled with ctx: a cancelled request may still be
	// applied by the server after a cleanup sent behind it (the server can
	// propose it after its context ended), which would leave a key behind.
	// It runs on while ctx lives, and for createGrace after ctx ends.
	ectx, ecancel := context.WithCancel(context.WithoutCancel(wctx))
	defer ecancel()
	stopGrace := context.AfterFunc(wctx, func() { time.AfterFunc(createGrace, ecancel) })
	defer stopGrace()
	var t turn
	var err error
	if m == tryTurn {
		t, err = sl.tryEnqueue(ectx, val)
	} else {
		t, err = sl.enqueue(ectx, val)
	}
	unknown := err != nil && t.wrote && t.hdr == nil // the create failed, and may yet be applied
	if err == nil && t.wrote && t.value == nil {
		sl.s.created(sl.key, t.rev) // a sweeper of the key leaves it to us
	}
	hdr := t.hdr
	switch {
	case err != nil:
	case wctx.Err() != nil:
		err = wctx.Err()
	case t.blocked() && m == tryTurn:
		err = fmt.Errorf("%w: %s is held by %s (create revision %d)", ErrLocked, sl.name(), t.ahead[0].Key, t.ahead[0].CreateRevision)
	case t.blocked():
		hdr, err = t.wait(wctx)
	}
	var h *hold
	if err == nil {
		if h = newHold(sl, t.rev, hdr); !h.live() { // the session ended at this instant
			err = sl.s.endedErr()
		}
	}
	if err == nil {
		return h, t.value, nil
	}
	err = sl.why(ctx, err)
	switch {
	case unknown: // the session removes the key if it was, or will be, created
		sl.s.sweep(sl.key)
	case t.wrote:
		err = errors.Join(err, sl.withdraw(t.rev))
	}
	if h != nil {
		h.finish(err)
	} else {
		sl.s.releaseKey(sl.key)
	}
	return nil, nil, err
}

// unsure reports whether a write that failed with err may have been applied,
// or may still be: anything but the server's definite refusal.
func unsure(err error) bool {
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

// why wraps err with what ended the call: the caller's context, or the session.
func (sl *slot) why(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("etcdsync: acquire %s: %w", sl.name(), ctx.Err())
	case sl.s.ctx.Err() != nil:
		return sl.s.endedErr()
	}
	return err
}
