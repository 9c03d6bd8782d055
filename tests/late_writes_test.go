package tests

// Writes the server applies late: a Proclaim or a try's create whose caller
// gave up (its ctx ended) but that reaches etcd afterwards, behind newer
// writes. The client sees its call fail; the server applies it later.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
)

// lateTxns holds back the Txns that put a chosen value: the caller's call
// fails when its ctx ends, and the request is sent, as it was, only when
// the test lets it go (as a server that applies a request late would).
type lateTxns struct {
	mu     sync.Mutex
	value  string // the put value to hold back; "" none
	held   []func() error
	caught chan struct{}
}

func newLateTxns() *lateTxns { return &lateTxns{caught: make(chan struct{}, 16)} }

func (l *lateTxns) hold(value string) {
	l.mu.Lock()
	l.value = value
	l.mu.Unlock()
}

func putsValue(req *pb.TxnRequest, value string) bool {
	for _, op := range req.Success {
		if p := op.GetRequestPut(); p != nil && string(p.Value) == value {
			return true
		}
	}
	return false
}

func (l *lateTxns) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		treq, ok := req.(*pb.TxnRequest)
		l.mu.Lock()
		catch := ok && l.value != "" && putsValue(treq, l.value)
		if catch {
			l.value = ""
			l.held = append(l.held, func() error {
				return invoker(context.Background(), method, req, &pb.TxnResponse{}, cc, opts...)
			})
		}
		l.mu.Unlock()
		if !catch {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		l.caught <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	})
}

// release sends the held requests now, in order.
func (l *lateTxns) release(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	held := l.held
	l.held = nil
	l.mu.Unlock()
	require.NotEmpty(t, held, "no request was held back")
	for _, send := range held {
		require.NoError(t, send())
	}
}

func lateTxnClient(t *testing.T, c *etcdtest.Cluster) (*clientv3.Client, *lateTxns) {
	l := newLateTxns()
	return c.Client(t, l.dial()), l
}

func valueOf(t *testing.T, cli *clientv3.Client, key string) (string, bool) {
	t.Helper()
	resp, err := cli.Get(ctxT(t), key)
	require.NoError(t, err)
	if len(resp.Kvs) == 0 {
		return "", false
	}
	return string(resp.Kvs[0].Value), true
}

// proclaimedLate makes a leader of name (value v0) whose Proclaim of v1
// failed on the client (its ctx ended) while the request is held back: late
// sends it on when the test says. It returns the leader, an admin client,
// late and a test context.
func proclaimedLate(t *testing.T, name string) (*etcdsync.Election, *clientv3.Client, *lateTxns, context.Context) {
	t.Helper()
	c := single(t)
	cli, late := lateTxnClient(t, c)
	ctx := ctxT(t)
	e := etcdsync.NewElection(session(t, cli), name)
	require.NoError(t, e.Campaign(ctx, "v0"))
	late.hold("v1")
	pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, e.Proclaim(pctx, "v1"), context.DeadlineExceeded)
	return e, c.Client(t), late, ctx
}

// A Proclaim that failed on the client and lands after a newer one writes
// nothing: the newer value stays.
func TestProclaimAppliedLateAfterNewerWritesNothing(t *testing.T) {
	t.Parallel()
	e, admin, late, ctx := proclaimedLate(t, "late-proclaim")
	require.NoError(t, e.Proclaim(ctx, "v2"))
	late.release(t)
	v, ok := valueOf(t, admin, e.Key())
	require.True(t, ok)
	require.Equal(t, "v2", v, "the late Proclaim overwrote the newer one")
	require.NoError(t, e.Proclaim(ctx, "v3"), "the term goes on")
	v, _ = valueOf(t, admin, e.Key())
	require.Equal(t, "v3", v)
}

// A Proclaim that failed on the client and lands before the next one: the
// next one still writes its value over it.
func TestProclaimAfterLateOneLandedWins(t *testing.T) {
	t.Parallel()
	e, admin, late, ctx := proclaimedLate(t, "late-proclaim-first")
	late.release(t)
	v, _ := valueOf(t, admin, e.Key())
	require.Equal(t, "v1", v, "the late one landed")
	require.NoError(t, e.Proclaim(ctx, "v2"))
	v, _ = valueOf(t, admin, e.Key())
	require.Equal(t, "v2", v)
	resp, err := admin.Get(ctx, e.Key())
	require.NoError(t, err)
	require.Equal(t, e.Rev(), resp.Kvs[0].CreateRevision)
}

// A late Proclaim of a term that was resigned, and of a term after which the
// same session campaigned again (the same key, a new create revision),
// writes nothing: it never creates the key, nor sets the new term's value.
func TestProclaimAppliedLateAcrossTermsWritesNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli, late := lateTxnClient(t, c)
	admin := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "late-proclaim-terms")
	require.NoError(t, e.Campaign(ctx, "t1"))
	late.hold("stale")
	pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	require.Error(t, e.Proclaim(pctx, "stale"))
	cancel()
	require.NoError(t, e.Resign(ctx))
	late.release(t)
	_, ok := valueOf(t, admin, keyOf("late-proclaim-terms", s))
	require.False(t, ok, "a late Proclaim recreated a resigned key")

	require.NoError(t, e.Campaign(ctx, "t2"))
	late.hold("stale2")
	pctx, cancel = context.WithTimeout(ctx, 200*time.Millisecond)
	require.Error(t, e.Proclaim(pctx, "stale2"))
	cancel()
	require.NoError(t, e.Resign(ctx))
	f := etcdsync.NewElection(s, "late-proclaim-terms") // another value of the session, same key
	require.NoError(t, f.Campaign(ctx, "t3"))
	late.release(t)
	v, _ := valueOf(t, admin, f.Key())
	require.Equal(t, "t3", v, "a late Proclaim of the last term wrote over the new one")
	require.NoError(t, f.Proclaim(ctx, "t4"))
	require.ErrorIs(t, e.Proclaim(ctx, "x"), etcdsync.ErrElectionNotLeader)
}

// Proclaims from many goroutines through two handles of one term
// (ResumeElection): each returns nil, the key's value is the one of the
// Proclaim that returned last, and the term is intact.
func TestConcurrentProclaimsThroughTwoHandles(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e1 := etcdsync.NewElection(s, "proclaim-many")
	require.NoError(t, e1.Campaign(ctx, "start"))
	e2 := etcdsync.ResumeElection(s, "proclaim-many", e1.Key(), e1.Rev())
	require.NoError(t, e2.Err())
	var mu sync.Mutex
	var lastVal string
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			e := e1
			if g%2 == 1 {
				e = e2
			}
			for i := range 20 {
				v := fmt.Sprintf("g%d-%d", g, i)
				// Lock around the call: the value written last is the one
				// whose Proclaim returned last under mu.
				mu.Lock()
				err := e.Proclaim(ctx, v)
				if err == nil {
					lastVal = v
				}
				mu.Unlock()
				if err != nil {
					t.Errorf("Proclaim %s: %v", v, err)
					return
				}
			}
		})
	}
	wg.Wait()
	v, _ := valueOf(t, cli, e1.Key())
	require.Equal(t, lastVal, v)
	require.Equal(t, e1.Rev(), e2.Rev())
	require.NoError(t, e1.Check())
	require.NoError(t, e2.Check())

	// Unsynchronised, racing a Resign: every Proclaim returns nil or
	// ErrElectionNotLeader, and none recreates the key.
	for g := range 6 {
		wg.Go(func() {
			e := e1
			if g%2 == 1 {
				e = e2
			}
			for i := range 20 {
				if err := e.Proclaim(ctx, fmt.Sprintf("r%d-%d", g, i)); err != nil && !errors.Is(err, etcdsync.ErrElectionNotLeader) {
					t.Errorf("Proclaim: %v", err)
				}
			}
		})
	}
	time.Sleep(5 * time.Millisecond)
	require.NoError(t, e2.Resign(ctx))
	wg.Wait()
	require.Empty(t, keys(t, cli, "proclaim-many/"))
}

// A TryCampaign whose create the server applies after the caller gave up
// leaves no key once the session learns of it (the session sweeps it);
// the next candidate leads.
func TestTryCampaignCreateAppliedLateLeavesNoKey(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli, late := lateTxnClient(t, c)
	admin := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "late-try")
	late.hold("try")
	tctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err := e.TryCampaign(tctx, "try")
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Zero(t, e.Rev())
	late.release(t)
	waitNoKeys(t, admin, "late-try/")
	b := etcdsync.NewElection(session(t, admin), "late-try")
	require.NoError(t, b.TryCampaign(ctx, "b"), "nobody leads")
	require.ErrorIs(t, e.Check(), etcdsync.ErrNotHeld, "not leading")
	require.Equal(t, "b", leaderValue(t, b))
}
