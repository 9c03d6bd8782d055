package etcdsync

// The pulse: the keepalives of every session of one client, sent in rounds.
// Beats that fall due together go in one round: one LeaseKeepAlive stream
// of its own, one request per lease, each reply matched to its request by
// the lease (one request per lease per stream), closed once every reply is
// in. A beat keeps its own send time, so the local deadline stays exact on
// a connection to etcd. (Through etcd's gRPC proxy it can run late by up
// to the proxy's own keepalive pace and a tick: the proxy keeps each lease
// alive with one keepalive of its own and answers a beat with whichever of
// its renewals replies next; see README, Where it runs.) The
// sessions of a client align their beats on a grid (beatGrid), so that a
// client with many sessions opens a few streams per TTL, not three per
// session.

import (
	"context"
	"fmt"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// pulse sends the beats of one client's sessions in rounds.
type pulse struct {
	lc pb.LeaseClient // on the client's own connection

	mu      sync.Mutex
	forming *round // takes beats until it is sent; nil when none is
}

// newPulse returns the pulse of cli, or nil when its keepalives must go
// through its Lease (an in-process client has no connection; a Lease the
// user wrapped must see every call).
func newPulse(cli *clientv3.Client) *pulse {
	if cli.ActiveConnection() == nil || fmt.Sprintf("%T", cli.Lease) != "*clientv3.lessor" {
		return nil
	}
	return &pulse{lc: pb.NewLeaseClient(cli.ActiveConnection())}
}

// round is one stream's worth of beats.
type round struct {
	waiting map[clientv3.LeaseID]*beatOf // by lease: one request each
	left    int                          // beats still waiting for their reply (pulse.mu)
	stop    context.CancelFunc           // ends the round's stream
}

// beatOf is a lease's request in a round and the beats that wait for it.
type beatOf struct {
	bound time.Duration // the longest TTL among them: a later reply extends nothing
	reply chan reply    // closed over r once answered
	r     reply
}

// gather is how long the first beat of a round waits for the others that
// fall due with it (on the same grid point) before the round is sent.
const gather = 2 * time.Millisecond

// beat sends a keepalive of lease id in the next round and waits for its
// reply, bounded by ctx and ttl (as Session.beat).
func (p *pulse) beat(ctx context.Context, id clientv3.LeaseID, ttl time.Duration) reply {
	ctx, cancel := context.WithTimeout(ctx, ttl)
	defer cancel()
	p.mu.Lock()
	rd, first := p.forming, p.forming == nil
	if first {
		rd = &round{waiting: make(map[clientv3.LeaseID]*beatOf)}
		p.forming = rd
	}
	b := rd.waiting[id]
	if b == nil {
		b = &beatOf{reply: make(chan reply)}
		rd.waiting[id] = b
	}
	b.bound = max(b.bound, ttl)
	rd.left++
	p.mu.Unlock()
	if first {
		time.AfterFunc(gather, func() { p.send(rd) })
	}
	defer p.leave(rd)
	select {
	case <-b.reply:
		return b.r
	case <-ctx.Done():
		return reply{sent: time.Now(), err: fmt.Errorf("etcdsync: keepalive: %w", ctx.Err())}
	}
}

// leave counts a beat out of rd; the last one out ends its stream.
func (p *pulse) leave(rd *round) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if rd.left--; rd.left == 0 && rd.stop != nil {
		rd.stop()
	}
}

// send closes rd to more beats and runs its stream in a goroutine of its
// own, which ends once every reply is in, its bound passed, or every beat
// left (leave).
func (p *pulse) send(rd *round) {
	p.mu.Lock()
	if p.forming == rd {
		p.forming = nil
	}
	var bound time.Duration
	for _, b := range rd.waiting {
		bound = max(bound, b.bound)
	}
	if rd.left == 0 { // every beat left while it formed
		p.mu.Unlock()
		return
	}
	ctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(context.Background()), bound)
	rd.stop = cancel
	p.mu.Unlock()
	go func() {
		defer cancel()
		rd.run(ctx, p.lc)
	}()
}

// run sends one request per lease on a stream of its own and hands each
// reply to its beats; a failed stream fails those still waiting.
func (rd *round) run(ctx context.Context, lc pb.LeaseClient) {
	answer := func(b *beatOf, r reply) {
		b.r = r
		close(b.reply)
	}
	fail := func(sent time.Time, err error) {
		for id, b := range rd.waiting {
			answer(b, reply{sent: sent, err: fmt.Errorf("etcdsync: keepalive: %w", err)})
			delete(rd.waiting, id)
		}
	}
	opened := time.Now()
	st, err := lc.LeaseKeepAlive(ctx)
	if err != nil {
		fail(opened, err)
		return
	}
	sent := make(map[clientv3.LeaseID]time.Time, len(rd.waiting))
	for id := range rd.waiting {
		sent[id] = time.Now()
		if err := st.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
			fail(sent[id], err)
			return
		}
	}
	for len(rd.waiting) > 0 {
		resp, err := st.Recv()
		if err != nil {
			fail(opened, err)
			return
		}
		id := clientv3.LeaseID(resp.ID)
		b := rd.waiting[id]
		if b == nil {
			continue
		}
		delete(rd.waiting, id)
		if resp.TTL <= 0 { // as the server answers a lease it does not have
			answer(b, reply{sent: sent[id], err: fmt.Errorf("etcdsync: keepalive: %w", rpctypes.ErrLeaseNotFound)})
			continue
		}
		answer(b, reply{sent: sent[id], ttl: resp.TTL})
	}
	st.CloseSend()
}

// beatGrid is the step of the grid a pulsed session's beats fall on: the
// next beat goes at the last grid point before it is due (at most this much
// early), so that the sessions of a client with one TTL beat together.
func beatGrid(pace time.Duration) time.Duration { return pace / 8 }

// onGrid returns t moved back to the last point of the grid of step g
// (counted from the zero time, as time.Truncate does: the same grid for
// every session of the process), unless that is not after after.
func onGrid(t time.Time, g time.Duration, after time.Time) time.Time {
	if g <= 0 {
		return t
	}
	p := t.Truncate(g)
	if !p.After(after) {
		return t
	}
	return p
}
