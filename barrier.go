package etcdsync

// The barrier: one key, NAME itself (the key etcd's recipe Barrier uses),
// that blocks every Wait while it exists. Hold creates it (HoldFor binds it
// to a session's lease), Release deletes it, Wait reads it once and watches
// for its delete (queue.WatchGone, internal/queue/watchgone.go).

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Barrier blocks the processes that Wait on a name while the barrier is
// held, and lets them all go once it is released. It is etcd's recipe
// Barrier (go.etcd.io/etcd/client/v3/experimental/recipes) with contexts:
// the same key, NAME, so the two release each other's waiters.
//
// A barrier that Hold closes has no lease: it stays until a Release, by
// any process, also after its holder crashed. One that HoldFor closes is
// bound to a Session's lease: when the holder's session ends (Close, or
// its lease expires after a crash), the barrier opens and the waiters go
// on as after a Release; they cannot tell the two apart.
//
// All methods are safe for concurrent use.
type Barrier struct {
	cli  *clientv3.Client
	name string
	bad  error // why the client or name is unusable, or nil

	mu  sync.Mutex
	rev int64 // create revision of the barrier this value closed, 0: none
}

// NewBarrier returns the barrier on name (its key is name itself). It does
// not touch etcd. A nil client or an invalid name is reported by every call,
// with an error wrapping ErrInvalidArgument or ErrInvalidName.
func NewBarrier(cli *clientv3.Client, name string) *Barrier {
	b := &Barrier{cli: cli, name: name}
	if cli == nil {
		b.bad = fmt.Errorf("%w: barrier %s: nil client", ErrInvalidArgument, name)
	} else if err := queue.CheckName(name); err != nil {
		b.bad = err
	}
	return b
}

// Hold closes the barrier: it creates the key with no lease, so the
// barrier stays closed until someone calls Release, whatever becomes of
// this process (use HoldFor to have it open when the holder's session
// ends). It blocks for one RPC. When the barrier is already closed, by
// anyone (this value included), it returns an error wrapping ErrLocked and
// writes nothing.
//
// ctx bounds the call. A create still in flight when ctx ends runs on for
// up to a second to learn its outcome; one that committed is deleted again
// (fenced by its revision) and the call returns ctx's error. Only when the
// outcome stays unknown (the link broke) may the barrier be closed after
// an error.
func (b *Barrier) Hold(ctx context.Context) error { return b.hold(ctx, nil) }

// HoldFor is Hold with the barrier bound to s's lease: it opens, and the
// waiters go on, when s ends (Close, an expired lease after a crash, lost
// contact), if no Release came first. A barrier already closed with s's
// lease is this session's: HoldFor returns nil and this value holds it (a
// retried HoldFor, or a process that resumed s's lease with WithLease).
// An ended session gives its error (ErrSessionExpired or ErrSessionClosed),
// a nil one an error wrapping ErrInvalidArgument.
func (b *Barrier) HoldFor(ctx context.Context, s *Session) error {
	if s == nil {
		return fmt.Errorf("%w: barrier %s: nil session", ErrInvalidArgument, b.name)
	}
	return b.hold(ctx, s)
}

func (b *Barrier) hold(ctx context.Context, s *Session) error {
	if err := b.usable(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil { // nothing is sent
		return fmt.Errorf("etcdsync: hold barrier %s: %w", b.name, err)
	}
	lease := clientv3.NoLease
	if s != nil {
		if s.Err() != nil {
			return s.q.EndedErr()
		}
		lease = s.Lease()
	}
	// A request cancelled in flight may still be applied, and then nobody
	// would know to open the barrier again.
	cctx, cancel := graced(ctx)
	defer cancel()
	resp, err := b.cli.Txn(cctx).
		If(clientv3.Compare(clientv3.CreateRevision(b.name), "=", 0)).
		Then(clientv3.OpPut(b.name, "", clientv3.WithLease(lease))).
		Else(clientv3.OpGet(b.name)).
		Commit()
	switch {
	case err != nil && s != nil && errors.Is(err, rpctypes.ErrLeaseNotFound):
		return queue.Tag(fmt.Errorf("etcdsync: hold barrier %s: %w", b.name, err), ErrSessionExpired)
	case err != nil && ctx.Err() != nil:
		return fmt.Errorf("etcdsync: hold barrier %s: %w (the barrier may be closed: %w)", b.name, ctx.Err(), err)
	case err != nil:
		return fmt.Errorf("etcdsync: hold barrier %s: %w", b.name, err)
	case !resp.Succeeded: // the Get ran at the revision of the failed compare: the key is there
		kv := resp.Responses[0].GetResponseRange().GetKvs()[0]
		if s != nil && clientv3.LeaseID(kv.Lease) == lease {
			b.setRev(kv.CreateRevision)
			return nil
		}
		return fmt.Errorf("%w: barrier %s is held (create revision %d, lease %x)", ErrLocked, b.name, kv.CreateRevision, kv.Lease)
	case ctx.Err() != nil: // closed after ctx ended: open it again
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), queue.CreateGrace)
		defer dcancel()
		err := fmt.Errorf("etcdsync: hold barrier %s: %w", b.name, ctx.Err())
		if derr := queue.DeleteAtRev(dctx, b.cli, b.name, resp.Header.Revision); derr != nil {
			return fmt.Errorf("%w; it was closed at revision %d and stays closed: %w", err, resp.Header.Revision, derr)
		}
		return err
	}
	b.setRev(resp.Header.Revision)
	return nil
}

// setRev records the create revision of the barrier this value holds.
func (b *Barrier) setRev(rev int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rev = rev
}

// Release opens the barrier: every Wait returns. When this value closed it
// (Hold, HoldFor), Release deletes that barrier only, at the revision it was
// created (a retried Release never opens a barrier closed since); else it
// deletes whatever barrier is there, closed by any process (as etcd's
// recipe does). It blocks for one RPC bounded by ctx. On an RPC error
// nothing changes here, so it can be retried. When there is no barrier to
// open (never closed, released already, or its session ended) it returns an
// error wrapping ErrLockReleased, which callers may treat as success.
func (b *Barrier) Release(ctx context.Context) error {
	if err := b.usable(); err != nil {
		return err
	}
	b.mu.Lock()
	rev := b.rev
	b.mu.Unlock()
	if rev == 0 {
		resp, err := b.cli.Delete(ctx, b.name)
		switch {
		case err != nil:
			return fmt.Errorf("etcdsync: release barrier %s: %w", b.name, err)
		case resp.Deleted == 0:
			return fmt.Errorf("%w: barrier %s is not held", ErrLockReleased, b.name)
		}
		return nil
	}
	resp, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(b.name), "=", rev)).
		Then(clientv3.OpDelete(b.name)).Commit()
	if err != nil {
		return fmt.Errorf("etcdsync: release barrier %s: %w", b.name, err)
	}
	b.mu.Lock()
	if b.rev == rev { // no Hold of this value since
		b.rev = 0
	}
	b.mu.Unlock()
	if !resp.Succeeded {
		return fmt.Errorf("%w: the barrier %s this value held (create revision %d) was already released", ErrLockReleased, b.name, rev)
	}
	return nil
}

// Wait blocks until the barrier is open. It returns nil at once when the
// barrier is not held; else once the barrier it saw is released (Release by
// any process, etcd's recipe's included) or, for a HoldFor barrier, once
// its holder's session ended: it cannot tell these apart. A barrier
// released and held again while Wait watched counts as released. It reads
// the key once (linearizable: a lagging member never makes it pass a held
// barrier) and keeps one watch from that read's revision; when the watch
// fails (compaction, a member restart, a lost leader) it reads once more
// and watches again, rather than give up or pass. It returns an error
// wrapping ctx.Err() when ctx ends first, and holds nothing in etcd.
func (b *Barrier) Wait(ctx context.Context) error {
	if err := b.usable(); err != nil {
		return err
	}
	resp, err := b.cli.Get(ctx, b.name)
	if err != nil {
		return fmt.Errorf("etcdsync: wait for barrier %s: %w", b.name, err)
	}
	if len(resp.Kvs) == 0 {
		return nil
	}
	if _, err := queue.WatchGone(ctx, b.cli, b.name, resp.Kvs[0].CreateRevision, resp.Header.Revision+1); err != nil {
		return fmt.Errorf("etcdsync: wait for barrier %s: %w", b.name, err)
	}
	return nil
}

// usable returns why the barrier cannot be used (a bad name or client, a
// closed client), else nil.
func (b *Barrier) usable() error {
	if b.bad != nil {
		return b.bad
	}
	return queue.ClosedClient(b.cli)
}

// graced returns a context for a create that must not be cancelled with
// ctx (see Slot.enter): it ends createGrace after ctx does, so that the
// caller learns the create's outcome and can undo it. The returned
// function releases it.
func graced(ctx context.Context) (context.Context, func()) {
	gctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(queue.CreateGrace, cancel) })
	return gctx, func() { stop(); cancel() }
}
