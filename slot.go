package etcdsync

// A contender's place (type slot): its session, the name's prefix NAME/, its
// key NAME/<lease-hex> (or NAME/<dir>/<lease-hex> under a rule with a
// directory) and the rule that says whom it waits for; how it lists the
// queue, acquires (acquire.go) and withdraws its key. Only direct children of
// the prefix take part in a queue.

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// checkName validates a primitive's name.
func CheckName(name string) error {
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
type Slot struct {
	Session *Session
	Prefix  string // NAME/
	Key     string // NAME/<lease-hex>, or NAME/read/<lease-hex> and so on (rule.dir)
	Kind    string // of primitive: mutex, election, rwmutex, semaphore, group
	Rule    *Rule
}

// name is the primitive's name: the prefix without its slash.
func (sl *Slot) Name() string { return strings.TrimSuffix(sl.Prefix, "/") }

func NewSlot(s *Session, name, kind string) (Slot, error) {
	if s == nil {
		return Slot{}, fmt.Errorf("%w: nil session", ErrInvalidArgument)
	}
	if err := CheckName(name); err != nil {
		return Slot{}, err
	}
	return Slot{Session: s, Prefix: name + "/", Kind: kind}.With(&Exclusive), nil
}

// with returns the slot under rule r, its key in r's directory. The prefix
// is the start of the key's string, so a slot holds one string, not two.
func (sl Slot) With(r *Rule) Slot {
	n := len(sl.Prefix)
	sl.Rule, sl.Key = r, sl.Prefix+r.Dir+strconv.FormatInt(int64(sl.Session.Lease()), 16)
	sl.Prefix = sl.Key[:n]
	return sl
}

// isChild reports whether key is a direct child NAME/<hex> of prefix: the
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
	if sl.Rule.Blocks == nil {
		return clientv3.OpGet(sl.Key)
	}
	return clientv3.OpGet(sl.Prefix, sl.listOpts(false)...)
}

// listOpts lists the keys under the prefix in create-revision order, with
// their values only when the rule weighs them; unless full, under a rule
// that needs only the newest keys (rule.newest), the newest listLimit of
// them, newest first (see turn.list), so that a reply does not grow with
// the queue.
func (sl *Slot) listOpts(full bool) []clientv3.OpOption {
	if sl.Rule.newest && !full {
		return []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithKeysOnly(),
			clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortDescend), clientv3.WithLimit(listLimit)}
	}
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	if sl.Rule.weigh == nil {
		opts = append(opts, clientv3.WithKeysOnly())
	}
	return opts
}

// listLimit is how many of the newest keys a limited list has: ours and
// three before it, of which a waiter watches two.
const listLimit = 4

// withdraw deletes the key this call may have written: the one at rev, or
// (rev 0: the create's outcome is unknown) the key with our lease created
// after the session began that a read finds, at its create revision; never a
// hold that a restarted process resumes (WithLease), and, however late the
// server applies it, never a later hold. When it fails the session sweeps
// the key (see Session.sweep). It runs under a short bounded context of its
// own, as it cleans up after calls whose context may have ended.
func (sl *Slot) Withdraw(rev int64) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sl.Session.ctx), CreateGrace)
	defer cancel()
	err := sl.deleteAt(ctx, rev)
	if err != nil {
		sl.Session.Reg.disown(sl.Key, rev) // before the key's claim is freed: the sweeper acts
		sl.Session.Reg.Sweep(sl.Key)
		return fmt.Errorf("etcdsync: remove %s after a failed acquire: %w", sl.Key, err)
	}
	return nil
}

// deleteAt deletes our key at create revision rev; with rev 0, the key with
// our lease created after the session began, if any.
func (sl *Slot) deleteAt(ctx context.Context, rev int64) error {
	if rev == 0 {
		resp, err := sl.Session.client.Get(ctx, sl.Key)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 || !sl.Session.made(resp.Kvs[0]) {
			return nil
		}
		rev = resp.Kvs[0].CreateRevision
	}
	return DeleteAtRev(ctx, sl.Session.client, sl.Key, rev)
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
	hs, value, err := Acquire(ctx, []*Slot{sl}, val, m)
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
	case sl.Session.ctx.Err() != nil:
		return sl.Session.EndedErr()
	}
	return err
}

// resume returns a hold of the slot's key at rev without touching etcd, for a
// value that takes over a hold (ResumeElection): the live hold of a value of
// this session when it holds the key at rev (the two values then share one
// hold), else a new one when no value of the session uses the key. A hold at
// rev that is gone shows at the first guarded call or through Done.
func (sl *Slot) Resume(rev int64) (*Hold, error) {
	sl.Session.Reg.mu.Lock()
	h := sl.Session.Reg.keys[sl.Key].hold
	sl.Session.Reg.mu.Unlock()
	switch {
	case h != nil && h.Live() && h.Kind != sl.Kind:
		return nil, fmt.Errorf("%w: %s is held by a %s of this session", ErrNotHeld, sl.Key, h.Kind)
	case h != nil && h.Live() && h.Rev == rev:
		return h, nil
	case h != nil && h.Live():
		return nil, fmt.Errorf("%w: %s is held by this session at revision %d, not %d", ErrNotHeld, sl.Key, h.Rev, rev)
	}
	if err := sl.Session.Reg.ClaimKey(context.Background(), sl.Key, false); err != nil {
		return nil, err
	}
	return newHold(sl, rev, &pb.ResponseHeader{Revision: rev}), nil
}

// blocking returns the keys of kvs (sorted by create revision) created before
// rev that block, oldest first. A key whose weight the rule cannot read is an
// error wrapping ErrInvalidArgument.
func (sl *Slot) blocking(kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
	return sl.Rule.blocking(sl.Prefix, kvs, rev)
}
