package queue

// A contender's key on a name (type Slot): its session, the name's prefix
// NAME/, its key NAME/<lease-hex> (or NAME/<dir>/<lease-hex> under a rule
// with a directory), and the rule (rule.go) that says whom it waits for;
// the lists of the keys under the prefix; its acquire and the withdrawal of
// a key it may have written. Only direct children of the prefix take part
// in a queue. How it gets its turn is in acquire.go.

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
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

// Slot is one contender's key on a name: the session, the name's prefix,
// the key, and the rule that says whom it waits for.
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

// NewSlot returns the slot of a value of kind on name for session s, its
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
// them, newest first (see place.list), so that a reply does not grow with
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

// Withdraw deletes the key this call may have written: the one at rev, or
// (rev 0: the create's outcome is unknown) the key with our lease created
// after the session began that a read finds, at its create revision; never a
// hold that a restarted process resumes (WithLease), and, however late the
// server applies it, never a later hold. When it fails the session sweeps
// the key (see Session.sweep). It runs under a short bounded context of its
// own, as it cleans up after calls whose context may have ended.
func (sl *Slot) Withdraw(rev int64) error {
	ctx, cancel := sl.session.graced()
	defer cancel()
	return sl.withdrawIn(ctx, rev)
}

// withdrawIn is Withdraw bounded by ctx: the keys of one acquire share one
// grace (enter), so that its cleanup takes CreateGrace however many names.
func (sl *Slot) withdrawIn(ctx context.Context, rev int64) error {
	err := sl.deleteAt(ctx, rev)
	if err != nil {
		sl.session.reg.disown(sl.key, rev) // before the key's claim is freed: the sweeper acts
		sl.session.reg.sweep(sl.key)
		return fmt.Errorf("etcdsync: key %s left for the session to remove once etcd answers: %w", sl.key, err)
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
