package etcdsync

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Observer follows the leader of an election on a name. It needs no Session
// (no lease), so a process that only watches the leader holds nothing in etcd.
// All methods are safe for concurrent use.
type Observer struct {
	cli    *clientv3.Client
	name   string
	prefix string
	bad    error // why the client or name is unusable, or nil

	mu  sync.Mutex
	err error // why an Observe channel closed before its ctx ended
}

// NewObserver returns an Observer of the election on name. It does not touch
// etcd. A nil client or an invalid name is reported by every call (Observe's
// channel then closes at once and Err says why).
func NewObserver(cli *clientv3.Client, name string) *Observer {
	o := &Observer{cli: cli, name: name, prefix: name + "/"}
	if cli == nil {
		o.bad = fmt.Errorf("%w: nil client", ErrInvalidArgument)
	} else if err := checkName(name); err != nil {
		o.bad = err
	}
	return o
}

// Leader returns the current leader's key and value (one KeyValue), or an
// error wrapping ErrElectionNoLeader. It blocks for one RPC bounded by ctx.
// Only direct children NAME/<hex> are candidates.
func (o *Observer) Leader(ctx context.Context) (*clientv3.GetResponse, error) {
	if err := o.usable(); err != nil {
		return nil, err
	}
	resp, err := o.read(ctx, 0)
	if err != nil {
		return nil, fmt.Errorf("etcdsync: leader of %s: %w", o.name, err)
	}
	if kv := leaderOf(o.prefix, resp.Kvs); kv != nil {
		resp.Kvs, resp.Count, resp.More = []*mvccpb.KeyValue{kv}, 1, false
		return resp, nil
	}
	return nil, fmt.Errorf("%w: %s", ErrElectionNoLeader, o.name)
}

// usable returns why the observer cannot be used (a bad name or client, or
// a closed client: ErrInvalidArgument), else nil.
func (o *Observer) usable() error {
	switch {
	case o.bad != nil:
		return o.bad
	case o.cli.Ctx().Err() != nil:
		return fmt.Errorf("%w: client closed", ErrInvalidArgument)
	}
	return nil
}

// Err returns why an Observe channel closed before its context ended (an
// invalid name or client, a closed client: ErrInvalidArgument), else nil.
func (o *Observer) Err() error {
	if o.bad != nil {
		return o.bad
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// Observe returns a channel that delivers the leader current when it starts
// (or, with none, the next one), then each later leader and each value it
// proclaims, in revision order: a reader that keeps up gets every one. A slow
// reader may miss values only across a compaction of the history it needs,
// and always gets the latest. It never reports a candidate that is not the
// leader, nor a key other than a direct child NAME/<hex>. Each response's
// header carries the revision at which its value became current. It does not
// block; the channel closes when ctx ends (ctx owns the goroutine), or early
// when the client closes (Err says why).
func (o *Observer) Observe(ctx context.Context) <-chan *clientv3.GetResponse {
	ch := make(chan *clientv3.GetResponse)
	if err := o.usable(); err != nil {
		o.mu.Lock()
		o.err = err
		o.mu.Unlock()
		close(ch)
		return ch
	}
	go func() {
		defer close(ch)
		if err := o.observe(ctx, ch); err != nil {
			o.mu.Lock()
			o.err = err
			o.mu.Unlock()
		}
	}()
	return ch
}

// observe reads the candidates at a revision, then follows one prefix watch
// from there: with no leader, the first direct child created is the next
// leader; each put of the leader's key is a proclamation; its delete at D
// ends the term, and the read at D says who leads next. A failed watch reads
// again where it stopped. It returns nil when ctx ends.
func (o *Observer) observe(ctx context.Context, ch chan<- *clientv3.GetResponse) error {
	var last *mvccpb.KeyValue
	send := func(hdr *pb.ResponseHeader, rev int64, kv *mvccpb.KeyValue) bool {
		if last != nil && string(last.Key) == string(kv.Key) && last.ModRevision == kv.ModRevision {
			return true // delivered already
		}
		h := &pb.ResponseHeader{ClusterId: hdr.ClusterId, MemberId: hdr.MemberId, Revision: rev, RaftTerm: hdr.RaftTerm}
		select {
		case ch <- &clientv3.GetResponse{Header: h, Kvs: []*mvccpb.KeyValue{kv}, Count: 1}:
			last = kv
			return true
		case <-ctx.Done():
			return false
		}
	}
	at := int64(0) // the revision to read at next; 0: the current one
	for ctx.Err() == nil {
		resp, err := o.read(ctx, at)
		if errors.Is(err, rpctypes.ErrCompacted) {
			at = 0 // the history is gone: the latest will do
			continue
		}
		if err != nil {
			if err := o.usable(); err != nil {
				return fmt.Errorf("etcdsync: observe %s: %w", o.name, err)
			}
			if sleep(ctx, retryPause) != nil {
				return nil
			}
			continue
		}
		if at == 0 { // a read at a past revision has the current one in its header
			at = resp.Header.Revision
		}
		leader := leaderOf(o.prefix, resp.Kvs)
		if leader != nil && !send(resp.Header, at, leader) {
			return nil
		}
		if at = o.follow(ctx, resp.Header, at, leader, send); at < 0 {
			// The watch ended (ctx, a lost leader, a member restart):
			// read again where it stopped.
			if at = -at; sleep(ctx, retryPause) != nil {
				return nil
			}
		}
	}
	return nil
}

// follow watches the prefix from after revision at, where leader was current
// (nil: none yet), and delivers each leader and value. It returns the
// revision of the leader's delete, or -(the last revision it saw) when the
// watch ended.
func (o *Observer) follow(ctx context.Context, hdr *pb.ResponseHeader, at int64, leader *mvccpb.KeyValue, send func(*pb.ResponseHeader, int64, *mvccpb.KeyValue) bool) int64 {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	seen := at
	for wr := range o.cli.Watch(wctx, o.prefix, clientv3.WithPrefix(), clientv3.WithRev(at+1)) {
		if wr.Canceled {
			break
		}
		for _, ev := range wr.Events {
			key := string(ev.Kv.Key)
			switch {
			case !isChild(o.prefix, key):
			case leader == nil && ev.IsCreate(), leader != nil && key == string(leader.Key) && ev.Type == mvccpb.PUT:
				leader = ev.Kv
				if !send(wr.Header, ev.Kv.ModRevision, ev.Kv) {
					return -seen
				}
			case leader != nil && key == string(leader.Key):
				return ev.Kv.ModRevision
			}
		}
		seen = max(seen, wr.Header.Revision)
	}
	return -seen
}

// read lists the candidates oldest first, at revision at (0: the current).
func (o *Observer) read(ctx context.Context, at int64) (*clientv3.GetResponse, error) {
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	if at > 0 {
		opts = append(opts, clientv3.WithRev(at))
	}
	return o.cli.Get(ctx, o.prefix, opts...)
}

// leaderOf returns the first direct child of prefix in kvs (sorted by create
// revision), or nil.
func leaderOf(prefix string, kvs []*mvccpb.KeyValue) *mvccpb.KeyValue {
	for _, kv := range kvs {
		if isChild(prefix, string(kv.Key)) {
			return kv
		}
	}
	return nil
}
