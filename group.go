package etcdsync

// Group membership: a member is a held key NAME/<lease-hex> with its value,
// under a rule that nothing blocks (joining is an acquire that never waits,
// and a member has a hold's loss signals); the members are one read of the
// direct children of NAME/, kept by one watch of the prefix.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Group is membership of a group on a name: who is in a pool right now, with
// their data. A member's key is NAME/<lease-hex>, bound to its session's
// lease (the key a Mutex would write), with the member's value: a member
// whose session ends (closed, expired, revoked) leaves by itself. Every direct
// child NAME/<hex> is a member, oldest first; keys of nested names
// (NAME/x/...) are not. A group's name is its own: a lock on it would queue
// behind the members, and Holders shows them as such a queue. All methods
// are safe for concurrent use.
//
// A Session is one member of a group: two Group values on one Session and
// name would share its key, so while one is a member a Join through the
// other returns an error wrapping ErrLocked at once.
type Group struct {
	hr      queue.Holder
	joining chan struct{} // one Join or Leave at a time on this value
}

// member is the rule of a group's member: no key blocks it, so its key holds
// as soon as it is written.
var member = queue.Unqueued("")

// NewGroup returns a Group on name for session s. It does not touch etcd. An
// invalid name or a nil session is reported by every call, with an error
// wrapping ErrInvalidName or ErrInvalidArgument (Watch's channel then
// closes at once).
func NewGroup(s *Session, name string) *Group {
	g := &Group{hr: queue.NewHolder(s.core(), name, "group", &member), joining: make(chan struct{}, 1)}
	return g
}

// Join makes the session a member with the value val: one RPC that writes
// the key if absent, bounded by ctx. It never waits for other members (Joins
// and Leaves on one value run one at a time). On a value that is a member it
// sets the member's value instead, in one RPC, keeping its place (a Join
// applied late never overwrites a newer one); when the membership is gone
// (its key deleted by someone), it joins anew. A session restarted with
// WithLease resumes its membership, in its old place, and sets val (when
// that fails, it returns the error and stays a member with the old value).
// When the session is a member through another value (another Group, or a
// lock on the same name) it returns an error wrapping ErrLocked at once and
// writes nothing. On an ended session it returns ErrSessionExpired or
// ErrSessionClosed. On error no key of this call is left behind, and a
// member stays one, with its old value.
func (g *Group) Join(ctx context.Context, val string) error {
	if err := g.lock(ctx, "join"); err != nil {
		return err
	}
	defer g.unlock()
	if h := g.hr.Current(); h != nil {
		_, err := h.Put(ctx, val)
		if !errors.Is(err, ErrNotHeld) {
			return err
		}
	}
	old, err := g.hr.Acquire(ctx, val, queue.JoinTurn)
	if errors.Is(err, ErrLocked) {
		return fmt.Errorf("etcdsync: join %s: another value of this session uses its key: %w", g.hr.Name(), err)
	}
	if err != nil || old == nil || string(old) == val {
		return err
	}
	// A restarted process's membership (WithLease), resumed with its old
	// value: it stays a member, also when setting val fails.
	h, err := g.hr.Held(ErrNotHeld)
	if err == nil {
		_, err = h.Put(ctx, val)
	}
	if err != nil {
		return fmt.Errorf("etcdsync: join %s resumed the membership, but setting its value failed: %w", g.hr.Name(), err)
	}
	return nil
}

// Leave ends the membership: it deletes the key only at the revision it was
// created, in one RPC bounded by ctx and by the membership (when that ends
// meanwhile it returns at once). It returns nil when this value is not a
// member (as Election.Resign), so a retried Leave is not an error; on an RPC
// error the value stays a member and Leave can be retried.
func (g *Group) Leave(ctx context.Context) error {
	if err := g.lock(ctx, "leave"); err != nil {
		return err
	}
	defer g.unlock()
	return resign(ctx, g.hr.Current())
}

// lock waits, bounded by ctx, until no other Join or Leave runs on g.
func (g *Group) lock(ctx context.Context, what string) error {
	if g.hr.Bad() != nil {
		return g.hr.Bad()
	}
	select {
	case g.joining <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("etcdsync: %s %s: %w", what, g.hr.Name(), ctx.Err())
	}
}

func (g *Group) unlock() { <-g.joining }

// Members returns the group's members at one revision, which it returns too,
// in join order: one linearizable read, bounded by ctx (see GroupMembers).
// It needs no membership, and works after the session ended.
func (g *Group) Members(ctx context.Context) ([]Entry, int64, error) {
	if g.hr.Bad() != nil {
		return nil, 0, g.hr.Bad()
	}
	return GroupMembers(ctx, g.hr.Session().Client(), g.hr.Name())
}

// Watch returns a channel of the group's views, kept by one watch (see
// WatchGroup). It needs no membership and no lease: it outlives the
// session, until ctx ends or the client closes. With an invalid name or a
// nil session the channel closes at once.
func (g *Group) Watch(ctx context.Context) <-chan GroupView {
	if g.hr.Bad() != nil {
		ch := make(chan GroupView)
		close(ch)
		return ch
	}
	return watchGroup(ctx, g.hr.Session().Client(), g.hr.Prefix())
}

// Key returns this member's key, or "" when not a member.
func (g *Group) Key() string { return g.hr.Key() }

// Rev returns the create revision of this member's key (its place in join
// order), or 0 when not a member.
func (g *Group) Rev() int64 { return g.hr.Rev() }

// Done returns a channel closed when the membership ends: Leave committed,
// the session ended, or the key was deleted by anyone. The first call for a
// membership starts one watch of its key. When not a member it returns a
// closed channel.
func (g *Group) Done() <-chan struct{} { return g.hr.Done() }

// Err returns nil while a member, else why the last membership ended (an
// error wrapping ErrLockReleased after Leave, ErrNotHeld when its key was
// deleted, ErrSessionExpired or ErrSessionClosed with the session), or
// ErrNotHeld if there never was one.
func (g *Group) Err() error { return g.hr.Err() }

// GroupView is a group's members at revision Rev, in join order (create
// revision, oldest first; members created by one transaction in key
// order, as Members gives them): exactly the direct children NAME/<hex> there are
// at Rev, and at every later revision up to the next view's. Held is true
// and Kind is "member" in every Entry. Views share their values' bytes:
// treat them as read-only.
//
// Resynced says that this view comes from a new read rather than from the
// watch: the history since the view before it was compacted, so what
// happened in between is unknown (a member may have joined and left).
type GroupView struct {
	Rev      int64
	Members  []Entry
	Resynced bool
}

// GroupMembers returns the members of the group on name at one revision,
// which it returns too, in join order (create revision, oldest first): one
// linearizable read through cli's KV, bounded by ctx. It needs no Session.
// A nil client or an invalid name is an error wrapping ErrInvalidArgument
// or ErrInvalidName.
func GroupMembers(ctx context.Context, cli *clientv3.Client, name string) ([]Entry, int64, error) {
	if err := checkGroup(cli, name); err != nil {
		return nil, 0, err
	}
	resp, err := readGroup(ctx, cli, name+"/")
	if err != nil {
		return nil, 0, fmt.Errorf("etcdsync: members of %s: %w", name, err)
	}
	return membersOf(name+"/", resp.Kvs), resp.Header.Revision, nil
}

// WatchGroup returns a channel of views of the group on name: the members
// when it starts (one linearizable read), then a view after each change
// (join, leave, a new value), each exact at its Rev, kept by one watch of the
// prefix from the read's revision on: no polling, no read per change. A
// watch that breaks (a member stopped, a lost leader) resumes where it
// stopped and misses nothing; one compacted past resyncs with one read, and
// that view says so (Resynced). A reader that falls behind never holds the
// watch back: it gets the latest view when it reads, and views it had no
// time for are dropped (only the newest waits for it). It needs no
// Session. It does not block: one goroutine, owned by ctx, keeps the view
// and closes the channel when ctx ends or cli closes. A nil client or an
// invalid name is an error, and no channel.
func WatchGroup(ctx context.Context, cli *clientv3.Client, name string) (<-chan GroupView, error) {
	if err := checkGroup(cli, name); err != nil {
		return nil, err
	}
	return watchGroup(ctx, cli, name+"/"), nil
}

// checkGroup validates a group reader's arguments.
func checkGroup(cli *clientv3.Client, name string) error {
	if cli == nil {
		return fmt.Errorf("%w: nil client", ErrInvalidArgument)
	}
	if err := queue.ClosedClient(cli); err != nil {
		return err
	}
	return queue.CheckName(name)
}

// readGroup reads the keys under prefix, oldest first, in one linearizable
// read.
func readGroup(ctx context.Context, cli *clientv3.Client, prefix string) (*clientv3.GetResponse, error) {
	return cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
}

// membersOf returns the members among kvs: the direct children of prefix,
// in join order (joinOrder).
func membersOf(prefix string, kvs []*mvccpb.KeyValue) []Entry {
	return keysIn(prefix, kvs, queue.IsChild)
}

// keysIn returns the keys of kvs under prefix that keep (given prefix and
// the key) takes, as members, in join order (joinOrder).
func keysIn(prefix string, kvs []*mvccpb.KeyValue, keep func(prefix, key string) bool) []Entry {
	out := []Entry{}
	for _, kv := range kvs {
		if keep(prefix, string(kv.Key)) {
			out = append(out, memberOf(kv))
		}
	}
	slices.SortFunc(out, joinOrder)
	return out
}

// joinOrder orders members by create revision, oldest first, and members
// created at one revision (by one transaction) by key, so that a read and a
// watch give one order.
func joinOrder(a, b Entry) int {
	return cmp.Or(cmp.Compare(a.Rev, b.Rev), strings.Compare(a.Key, b.Key))
}

func memberOf(kv *mvccpb.KeyValue) Entry {
	return Entry{Key: string(kv.Key), Rev: kv.CreateRevision, Lease: clientv3.LeaseID(kv.Lease), Value: kv.Value, Held: true, Kind: "member"}
}

// watchGroup starts the goroutines of WatchGroup (see watchKeys), with the
// direct children of prefix as the members.
func watchGroup(ctx context.Context, cli *clientv3.Client, prefix string) <-chan GroupView {
	return watchKeys(ctx, cli, prefix, queue.IsChild)
}

// watchKeys starts the goroutines of a view of the keys under prefix that
// keep takes: one keeps the view (read, watch), the other delivers the
// latest one as the reader takes it, so that neither waits for the other.
// The deliverer owns ch and closes it once the keeper has returned.
func watchKeys(ctx context.Context, cli *clientv3.Client, prefix string, keep func(prefix, key string) bool) <-chan GroupView {
	ch := make(chan GroupView)
	go func() {
		defer close(ch)
		gw := groupWatch{cli: cli, prefix: prefix, in: keep, changed: make(chan struct{}, 1)}
		kept := make(chan struct{})
		go func() {
			defer close(kept)
			gw.keep(ctx)
		}()
		gw.deliver(ctx, ch, kept)
		<-kept
	}()
	return ch
}

// groupWatch is the state of one WatchGroup: the members at rev, as the
// keeper knows them (in join order, with each key's create revision to
// find it: a change costs a binary search), and whether they changed since
// the deliverer last took a view of them (a copy made only when it is
// delivered).
type groupWatch struct {
	cli    *clientv3.Client
	prefix string
	in     func(prefix, key string) bool // which keys under prefix are in the view
	seen   int64                         // of the last event applied: a broken watch resumes after it (the keeper's)

	mu       sync.Mutex       // members, rev, resynced: the keeper changes them, the deliverer takes views
	members  []Entry          // in join order
	revs     map[string]int64 // key -> its create revision, for each of members
	rev      int64            // of the last read or member event applied: members are exact there
	resynced bool             // a resync not delivered yet
	dirty    bool             // a change not delivered yet
	changed  chan struct{}
}

// keep reads the members, then follows one watch from the read's revision,
// until ctx ends or the client closes. A watch that ends resumes after the
// last event applied, after a pause; one compacted past reads again first.
func (gw *groupWatch) keep(ctx context.Context) {
	for read := true; ; {
		if read && !gw.read(ctx) {
			return
		}
		read = gw.follow(ctx)
		if gw.cli.Ctx().Err() != nil || !read && queue.Pause(ctx) != nil {
			return
		}
	}
}

// read lists the members and publishes them (resynced unless it is the
// first read), retrying after a pause until it succeeds. It returns false
// when ctx ends or the client closes first.
func (gw *groupWatch) read(ctx context.Context) bool {
	first := gw.rev == 0
	for {
		resp, err := readGroup(ctx, gw.cli, gw.prefix)
		if err == nil {
			gw.mu.Lock()
			gw.members = keysIn(gw.prefix, resp.Kvs, gw.in)
			gw.revs = make(map[string]int64, len(gw.members))
			for _, m := range gw.members {
				gw.revs[m.Key] = m.Rev
			}
			gw.rev, gw.seen = resp.Header.Revision, resp.Header.Revision
			gw.resynced, gw.dirty = gw.resynced || !first, true
			gw.mu.Unlock()
			gw.publish()
			return true
		}
		if gw.cli.Ctx().Err() != nil || queue.Pause(ctx) != nil {
			return false
		}
	}
}

// follow watches the prefix from after the last event applied and applies
// each response, until the watch ends. It reports whether the watch was
// compacted past.
func (gw *groupWatch) follow(ctx context.Context) (compacted bool) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for wr := range gw.cli.Watch(wctx, gw.prefix, clientv3.WithPrefix(), clientv3.WithRev(gw.seen+1)) {
		switch {
		case wr.CompactRevision != 0:
			return true
		case wr.Canceled: // a lost leader, the client's own retries given up
			return false
		}
		gw.apply(wr.Events)
	}
	return false
}

// apply applies a watch response's events to the members, and publishes
// the result when they changed. Only direct children of the prefix are
// members.
func (gw *groupWatch) apply(evs []*clientv3.Event) {
	gw.mu.Lock()
	for _, ev := range evs {
		gw.seen = ev.Kv.ModRevision
		key := string(ev.Kv.Key)
		if !gw.in(gw.prefix, key) {
			continue
		}
		rev, in := gw.revs[key]
		i, _ := slices.BinarySearchFunc(gw.members, Entry{Key: key, Rev: rev}, joinOrder)
		switch {
		case ev.Type == mvccpb.DELETE && !in:
			continue
		case ev.Type == mvccpb.DELETE:
			gw.members = slices.Delete(gw.members, i, i+1)
			delete(gw.revs, key)
		case in: // a new value
			gw.members[i] = memberOf(ev.Kv)
		default: // a join: the newest key
			m := memberOf(ev.Kv)
			j, _ := slices.BinarySearchFunc(gw.members, m, joinOrder)
			gw.members = slices.Insert(gw.members, j, m)
			gw.revs[key] = m.Rev
		}
		gw.rev, gw.dirty = ev.Kv.ModRevision, true
	}
	gw.mu.Unlock()
	gw.publish() // a view only when one changed them (view)
}

// publish tells the deliverer that the members changed. It never blocks.
func (gw *groupWatch) publish() {
	select {
	case gw.changed <- struct{}{}:
	default: // told already
	}
}

// view returns the members at gw.rev in join order, resynced when a resync
// came since the last view; ok is false when nothing changed since (a
// change the last view already had).
func (gw *groupWatch) view() (v GroupView, ok bool) {
	gw.mu.Lock()
	defer gw.mu.Unlock()
	if !gw.dirty {
		return GroupView{}, false
	}
	v = GroupView{Rev: gw.rev, Members: append([]Entry{}, gw.members...), Resynced: gw.resynced}
	gw.resynced, gw.dirty = false, false
	return v, true
}

// deliver sends a view on ch after each change, made as the reader is
// ready to take it, until ctx ends or the keeper has returned. Changes
// while the reader is busy make one view (the one after the last of them):
// a view the reader takes may be older than the members by the changes
// that came while it was offered, and the next view follows at once.
func (gw *groupWatch) deliver(ctx context.Context, ch chan<- GroupView, kept <-chan struct{}) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-kept:
			return
		case <-gw.changed:
		}
		v, ok := gw.view()
		if !ok {
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-kept:
			return
		case ch <- v:
		}
	}
}
