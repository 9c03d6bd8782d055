package queue

// A contender's place (type Slot) and how it gets its turn: its session, the
// name's prefix NAME/, its key NAME/<lease-hex> (or NAME/<dir>/<lease-hex>
// under a rule with a directory), and the rule (type Rule) that says whom it
// waits for. Only direct children of the prefix take part in a queue.
//
// The blocking rules: which keys created before ours block us, what each
// weighs, how much blocking weight may remain ahead when we hold, and which
// of the keys ahead a waiter watches; one rule per primitive (Exclusive for a
// Mutex or an Election, ReadRule and WriteRule for an RWMutex, Permits for
// a Semaphore, none for a Group's member): the machinery is shared.
//
// The acquire step every primitive shares (Slot.acquire, acquireSlots): reserve
// the keys in the session (registry.go), write them if absent and list the
// queues in one transaction, wait for the turn (both turn.go) unless it is a
// try, and on any failure withdraw the key this call may have written,
// however late the server applies the create. Every request goes through the
// client's interfaces (KV, Watcher, Lease, Maintenance), so that a
// namespace, a wrapper, an in-process client or etcd's gRPC proxy sees it.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// CheckName validates a primitive's name.
func CheckName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty name", ErrInvalidName)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return fmt.Errorf("%w: name %q has a NUL byte", ErrInvalidName, name)
	}
	return nil
}

// Slot is one contender's place: the session, the name's prefix, the key,
// and the rule that says whom it waits for.
type Slot struct {
	session *Session
	prefix  string // NAME/
	key     string // NAME/<lease-hex>, or NAME/read/<lease-hex> and so on (rule.dir)
	kind    string // of primitive: mutex, election, rwmutex, semaphore, group
	rule    *Rule
}

// Name is the primitive's name: the prefix without its slash.
func (sl *Slot) Name() string { return strings.TrimSuffix(sl.prefix, "/") }

// Key is the slot's key, NAME/<lease-hex> or NAME/<dir><lease-hex>.
func (sl *Slot) Key() string { return sl.key }

// Prefix is the name's prefix, NAME/.
func (sl *Slot) Prefix() string { return sl.prefix }

// Kind is the kind of primitive: mutex, election, rwmutex, semaphore, group
// and so on.
func (sl *Slot) Kind() string { return sl.kind }

// Session is the slot's session.
func (sl *Slot) Session() *Session { return sl.session }

// Reserve reserves the slot's key in its session for one value (see
// registry.claimKey); when another value of the session uses it, it
// returns an error wrapping ErrLocked at once. It does not touch etcd.
// Unreserve frees the reservation, once.
func (sl *Slot) Reserve(ctx context.Context) error {
	return sl.session.reg.claimKey(ctx, sl.key, false)
}

// Unreserve frees the reservation Reserve made.
func (sl *Slot) Unreserve() { sl.session.reg.releaseKey(sl.key) }

// Sweep has the session delete the slot's key should a create of it whose
// outcome the caller could not learn be applied late (see registry.sweep).
// It does not block.
func (sl *Slot) Sweep() { sl.session.reg.sweep(sl.key) }

// NewSlot returns the place of a value of kind on name for session s, its
// key placed and blocked under rule r. It does not touch etcd.
func NewSlot(s *Session, name, kind string, r *Rule) (Slot, error) {
	if s == nil {
		return Slot{}, fmt.Errorf("%w: nil session", ErrInvalidArgument)
	}
	if err := CheckName(name); err != nil {
		return Slot{}, err
	}
	return Slot{session: s, prefix: name + "/", kind: kind}.with(r), nil
}

// with returns the slot under rule r, its key in r's directory. The prefix
// is the start of the key's string, so a slot holds one string, not two.
func (sl Slot) with(r *Rule) Slot {
	n := len(sl.prefix)
	sl.rule, sl.key = r, sl.prefix+r.dir+strconv.FormatInt(int64(sl.session.Lease()), 16)
	sl.prefix = sl.key[:n]
	return sl
}

// IsChild reports whether key is a direct child NAME/<hex> of prefix: the
// only keys that take part in a queue (a lock on NAME/x never blocks NAME).
func IsChild(prefix, key string) bool {
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

// listOp lists the keys under the prefix (see listOpts), limited when the
// rule needs only the newest; under a rule that nothing blocks, it reads
// only our own key (nothing can be ahead of it).
func (sl *Slot) listOp() clientv3.Op {
	if sl.rule.blocks == nil {
		return clientv3.OpGet(sl.key)
	}
	return clientv3.OpGet(sl.prefix, sl.listOpts(false)...)
}

// listOpts lists the keys under the prefix in create-revision order, with
// their values only when the rule weighs them; unless full, under a rule
// that needs only the newest keys (Rule.newest), the newest listLimit of
// them, newest first (see turn.list), so that a reply does not grow with
// the queue.
func (sl *Slot) listOpts(full bool) []clientv3.OpOption {
	if sl.rule.newest && !full {
		return []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithKeysOnly(),
			clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortDescend), clientv3.WithLimit(listLimit)}
	}
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	if sl.rule.weigh == nil {
		opts = append(opts, clientv3.WithKeysOnly())
	}
	return opts
}

// listLimit is how many of the newest keys a limited list has: ours and
// three before it, of which a waiter watches two.
const listLimit = 4

// Withdraw deletes the key this call may have written: the one at rev, or
// (rev 0: the create's outcome is unknown) the key with our lease created
// after the session began that a read finds, at its create revision; never a
// hold that a restarted process resumes (WithLease), and, however late the
// server applies it, never a later hold. When it fails the session sweeps
// the key (see Session.sweep). It runs under a short bounded context of its
// own, as it cleans up after calls whose context may have ended.
func (sl *Slot) Withdraw(rev int64) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sl.session.ctx), CreateGrace)
	defer cancel()
	err := sl.deleteAt(ctx, rev)
	if err != nil {
		sl.session.reg.disown(sl.key, rev) // before the key's claim is freed: the sweeper acts
		sl.session.reg.sweep(sl.key)
		return fmt.Errorf("etcdsync: remove %s after a failed acquire: %w", sl.key, err)
	}
	return nil
}

// deleteAt deletes our key at create revision rev; with rev 0, the key with
// our lease created after the session began, if any.
func (sl *Slot) deleteAt(ctx context.Context, rev int64) error {
	if rev == 0 {
		resp, err := sl.session.client.Get(ctx, sl.key)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 || !sl.session.made(resp.Kvs[0]) {
			return nil
		}
		rev = resp.Kvs[0].CreateRevision
	}
	return DeleteAtRev(ctx, sl.session.client, sl.key, rev)
}

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
func (sl *Slot) acquire(ctx context.Context, val string, m Mode) (*Hold, []byte, error) {
	hs, value, err := acquireSlots(ctx, []*Slot{sl}, val, m)
	if err != nil {
		return nil, nil, err
	}
	return hs[0], value, nil
}

// why wraps err with what ended the call: the caller's context, or the session.
func (sl *Slot) why(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("etcdsync: acquire %s: %w", sl.Name(), ctx.Err())
	case sl.session.ctx.Err() != nil:
		return sl.session.EndedErr()
	}
	return err
}

// Resume returns a hold of the slot's key at rev without touching etcd, for a
// value that takes over a hold (ResumeElection): the live hold of a value of
// this session when it holds the key at rev (the two values then share one
// hold), else a new one when no value of the session uses the key. A hold at
// rev that is gone shows at the first guarded call or through Done.
func (sl *Slot) resume(rev int64) (*Hold, error) {
	sl.session.reg.mu.Lock()
	h := sl.session.reg.keys[sl.key].hold
	sl.session.reg.mu.Unlock()
	switch {
	case h != nil && h.Live() && h.kind != sl.kind:
		return nil, fmt.Errorf("%w: %s is held by a %s of this session", ErrNotHeld, sl.key, h.kind)
	case h != nil && h.Live() && h.rev == rev:
		return h, nil
	case h != nil && h.Live():
		return nil, fmt.Errorf("%w: %s is held by this session at revision %d, not %d", ErrNotHeld, sl.key, h.rev, rev)
	}
	if err := sl.session.reg.claimKey(context.Background(), sl.key, false); err != nil {
		return nil, err
	}
	return newHold(sl, rev, &pb.ResponseHeader{Revision: rev}), nil
}

// blocking returns the keys of kvs (sorted by create revision) created before
// rev that block, oldest first. A key whose weight the rule cannot read is an
// error wrapping ErrInvalidArgument.
func (sl *Slot) blocking(kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
	return sl.rule.blocking(sl.prefix, kvs, rev)
}

// Rule says whom a contender waits for: which of the keys under its prefix
// created before its own block it, their weights, and how much blocking
// weight may remain ahead when it holds. A rule without blocks is one that
// no key blocks (a Group's member).
type Rule struct {
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
	// newest: every direct child blocks with weight 1 and none may remain,
	// so the newest few keys up to ours tell a waiter all it watches:
	// lists are limited to those (listLimit), not the whole queue.
	newest bool
}

// Exclusive is the rule of a Mutex or an Election: every direct child of the
// prefix created before ours blocks, and none may remain.
var Exclusive = Rule{blocks: func(prefix string, kv *mvccpb.KeyValue) bool { return IsChild(prefix, string(kv.Key)) }, newest: true}

// Unqueued is the rule of a key that waits for nobody, in directory dir
// under the prefix ("" for NAME/<hex>): a Group's member, a DoubleBarrier's
// party.
func Unqueued(dir string) Rule { return Rule{dir: dir} }

// Unshared returns r for holds that the session's values do not share (a
// MultiLock's read side under ReadRule).
func (r Rule) Unshared() Rule {
	r.shared = false
	return r
}

// Blocks reports whether kv, a key under prefix created before ours, blocks
// a key under r.
func (r *Rule) Blocks(prefix string, kv *mvccpb.KeyValue) bool {
	return r.blocks != nil && r.blocks(prefix, kv)
}

// In reports whether kv is a direct child of r's directory under prefix: a
// key placed under r.
func (r *Rule) In(prefix string, kv *mvccpb.KeyValue) bool { return inDirs(r.dir)(prefix, kv) }

// blocking is Slot.blocking for a key under prefix.
func (r *Rule) blocking(prefix string, kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
	if r.blocks == nil {
		return nil, nil
	}
	var out []*mvccpb.KeyValue
	for _, kv := range kvs {
		if kv.CreateRevision < rev && r.blocks(prefix, kv) {
			if r.weigh != nil {
				if _, err := r.weigh(kv); err != nil {
					return nil, err
				}
			}
			out = append(out, kv)
		}
	}
	return out, nil
}

// Holds reports whether a key created at rev under prefix holds under r,
// given the keys of kvs: the weight of those that block it leaves it room.
func (r *Rule) Holds(prefix string, kvs []*mvccpb.KeyValue, rev int64) (bool, error) {
	ahead, err := r.blocking(prefix, kvs, rev)
	return err == nil && r.weight(ahead) <= r.room, err
}

// weight is the total weight of kvs, blocking keys that blocking accepted.
// It saturates at math.MaxInt64.
func (r *Rule) weight(kvs []*mvccpb.KeyValue) int64 {
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

// ReadRule: a reader waits for the writers created before it, and its key
// is shared by the session's read holds; TryRLock writes at once when no
// writer key exists. A reader watches only the nearest writer, so that a
// writer's release reaches only the readers it lets in (those behind the
// next writer read once when their turn comes).
var ReadRule = Rule{dir: "read/", blocks: inDirs("write/"), free: "write/", shared: true, exact: true}

// WriteRule: a writer waits for every reader and writer created before it.
var WriteRule = Rule{dir: "write/", blocks: inDirs("read/", "write/")}

// inDirs returns a blocks rule: the key is a direct child NAME/<dir><id> of
// one of dirs, id in hex or decimal (etcd's recipes name keys by time).
func inDirs(dirs ...string) func(prefix string, kv *mvccpb.KeyValue) bool {
	return func(prefix string, kv *mvccpb.KeyValue) bool {
		rest, ok := strings.CutPrefix(string(kv.Key), prefix)
		if !ok {
			return false
		}
		for _, d := range dirs {
			if IsChild(d, rest) {
				return true
			}
		}
		return false
	}
}

// Permits is the rule of a request for n of capacity permits: every direct
// child of the prefix created before ours blocks with its permits, and
// capacity-n of them may remain.
func Permits(capacity, n int64) *Rule {
	return &Rule{
		blocks: Exclusive.blocks,
		room:   capacity - n,
		weigh: func(kv *mvccpb.KeyValue) (int64, error) {
			weight, cp, ok := SemaphoreValue(kv.Value)
			switch {
			case !ok:
				return 0, fmt.Errorf("%w: key %s has value %q, not a semaphore's <permits>/<capacity>", ErrInvalidArgument, kv.Key, kv.Value)
			case cp != capacity:
				return 0, fmt.Errorf("%w: key %s holds or waits for %d of %d permits, and this semaphore's capacity is %d", ErrInvalidArgument, kv.Key, weight, cp, capacity)
			}
			return weight, nil
		},
	}
}

// SemaphoreValue parses a semaphore key's value, "<permits>/<capacity>",
// with 1 <= permits <= capacity.
func SemaphoreValue(v []byte) (permits, capacity int64, ok bool) {
	w, c, cut := strings.Cut(string(v), "/")
	permits, err1 := strconv.ParseInt(w, 10, 64)
	capacity, err2 := strconv.ParseInt(c, 10, 64)
	return permits, capacity, cut && err1 == nil && err2 == nil && permits >= 1 && permits <= capacity
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
	for i, t := range ts {
		switch {
		case qerr != nil && t.wrote && t.hdr == nil: // the create failed, and may yet be applied: the session removes the key if it was, or will be, created
			t.session.reg.sweep(t.key)
		case t.wrote:
			err = errors.Join(err, t.Withdraw(t.rev))
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
