package tests

// Observers: every leader and value in order; errors close the channel;
// Terms checked against a model of leadership.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.etcd.io/etcd/client/v3/namespace"
	"google.golang.org/grpc"
)

// An observer started before any candidate gets every leader and every
// value, in order (as etcdctl elect -l does).
func TestObserveEveryValue(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		cnt := counter{created: make(chan struct{}, 100)}
		o := etcdsync.NewObserver(c.Client(t, cnt.dial()...), "every")
		octx, cancel := context.WithCancel(ctx)
		defer cancel()
		ch := o.Observe(octx)
		within(t, cnt.created, testTimeout, "the observer's watch created")

		cli := c.Client(t)
		alpha := etcdsync.NewElection(session(t, cli), "every")
		beta := etcdsync.NewElection(session(t, cli), "every")
		require.NoError(t, alpha.Campaign(ctx, "alpha is leading"))
		betaLeads := campaignAsync(ctx, beta, "beta is leading")
		for i := 1; i <= 3; i++ {
			require.NoError(t, alpha.Proclaim(ctx, fmt.Sprintf("alpha: report %d", i)))
		}
		require.NoError(t, alpha.Resign(ctx))
		require.NoError(t, <-betaLeads)
		require.NoError(t, beta.Proclaim(ctx, "beta: report 1"))
		want := []string{"alpha is leading", "alpha: report 1", "alpha: report 2", "alpha: report 3", "beta is leading", "beta: report 1"}
		var got []string
		var last int64
		for len(got) < len(want) {
			select {
			case resp, ok := <-ch:
				require.True(t, ok, "Observe's channel closed (%v) after %q", o.Err(), got)
				got = append(got, string(resp.Kvs[0].Value))
				require.Greater(t, resp.Header.Revision, last, "revision order")
				last = resp.Header.Revision
			case <-time.After(testTimeout):
				t.Fatalf("got %q, want %q", got, want)
			}
		}
		require.Equal(t, want, got)
		require.NoError(t, beta.Resign(ctx))
		require.NoError(t, o.Err())
	})
}

// Observers need no session; a bad name or client closes the channel at
// once and Err says why; so does a client that closes.
func TestObserverErrorsCloseChannel(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	for _, tc := range []struct {
		o    *etcdsync.Observer
		want error
	}{
		{etcdsync.NewObserver(c.Client(t), ""), etcdsync.ErrInvalidName},
		{etcdsync.NewObserver(c.Client(t), "a\x00b"), etcdsync.ErrInvalidName},
		{etcdsync.NewObserver(nil, "x"), etcdsync.ErrInvalidArgument},
	} {
		_, ok := <-tc.o.Observe(ctx)
		require.False(t, ok, "Observe's channel closes at once")
		require.ErrorIs(t, tc.o.Err(), tc.want)
		_, err := tc.o.Leader(ctx)
		require.ErrorIs(t, err, tc.want)
	}

	cli := etcdtest.NewClient(t, c.Endpoints())
	o := etcdsync.NewObserver(cli, "closing")
	_, err := o.Leader(ctx)
	require.ErrorIs(t, err, etcdsync.ErrElectionNoLeader)
	ch := o.Observe(ctx)
	require.NoError(t, cli.Close())
	select {
	case _, ok := <-ch:
		require.False(t, ok)
	case <-time.After(testTimeout):
		t.Fatal("Observe's channel did not close after the client closed")
	}
	require.ErrorContains(t, o.Err(), "client closed")
	require.ErrorIs(t, o.Err(), etcdsync.ErrInvalidArgument)
	_, err = o.Leader(ctx)
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument, "Leader on a closed client")
	_, ok := <-o.Observe(ctx)
	require.False(t, ok, "Observe on a closed client closes its channel at once")
	require.ErrorIs(t, o.Err(), etcdsync.ErrInvalidArgument)
}

// Terms reports "no leader" as its own state: at start with nobody
// campaigning, and each time a leader goes with no candidate behind it
// (resigned, or its lease gone), also after a compaction while nobody leads
// (etcd-io/etcd#7815). A leader followed by a queued candidate is never
// reported as a gap.
func TestTermsReportNoLeader(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	octx, cancel := context.WithCancel(ctx)
	terms := etcdsync.NewObserver(cli, "terms").Terms(octx)
	next := func() etcdsync.Term {
		t.Helper()
		select {
		case tm, ok := <-terms:
			require.True(t, ok, "Terms' channel closed")
			return tm
		case <-time.After(testTimeout):
			t.Fatal("Terms delivered nothing")
		}
		return etcdsync.Term{}
	}
	var last int64
	want := func(value string) {
		t.Helper()
		tm := next()
		require.Greater(t, tm.Rev, last, "revision order")
		last = tm.Rev
		if value == "" {
			require.Nil(t, tm.Leader, "no leader")
			return
		}
		require.NotNil(t, tm.Leader, "a leader with %q", value)
		require.Equal(t, value, string(tm.Leader.Value))
	}
	want("") // nobody campaigns yet

	as := session(t, cli, etcdsync.WithTTL(2*time.Second))
	a := etcdsync.NewElection(as, "terms")
	require.NoError(t, a.Campaign(ctx, "a1"))
	want("a1")
	require.NoError(t, a.Proclaim(ctx, "a2"))
	want("a2")
	b := etcdsync.NewElection(session(t, cli), "terms")
	bLeads := campaignAsync(ctx, b, "b1")
	waitKeys(t, cli, "terms/", 2)
	as.Orphan() // a's lease expires with b behind it: no gap
	require.NoError(t, <-bLeads)
	want("b1")
	require.NoError(t, b.Resign(ctx))
	want("")

	// Compacted past the last delete while nobody leads.
	resp, err := cli.Put(ctx, "terms-filler", "x")
	require.NoError(t, err)
	_, err = cli.Compact(ctx, resp.Header.Revision)
	require.NoError(t, err)
	cs := session(t, cli)
	cl := etcdsync.NewElection(cs, "terms")
	require.NoError(t, cl.Campaign(ctx, "c1"))
	want("c1")
	require.NoError(t, cs.Close())
	want("")

	cancel()
	for range terms { // closes when ctx ends
	}
	require.NoError(t, etcdsync.NewObserver(cli, "terms").Err())
}

// An observer started long after the leader campaigned and proclaimed, its
// revisions compacted since, gets the leader and its value at once, then
// each later value: Election.Observe, Observer.Observe and Observer.Terms
// alike (etcd-io/etcd#7815: etcd's Observe watched from the leader's
// ModRevision and, that revision compacted, closed its channel without
// reporting any leader).
func TestObserveLeaderOlderThanCompaction(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const name = "obs-compacted"
	l := etcdsync.NewElection(session(t, cli), name)
	require.NoError(t, l.Campaign(ctx, "v1"))
	require.NoError(t, l.Proclaim(ctx, "v2"))
	resp, err := cli.Put(ctx, name+"-filler", "x")
	require.NoError(t, err)
	_, err = cli.Compact(ctx, resp.Header.Revision)
	require.NoError(t, err)

	octx, cancel := context.WithCancel(ctx)
	byElection := etcdsync.NewElection(session(t, cli), name).Observe(octx)
	byObserver := etcdsync.NewObserver(cli, name).Observe(octx)
	terms := etcdsync.NewObserver(cli, name).Terms(octx)
	t.Cleanup(func() {
		cancel()
		for range byElection {
		}
		for range byObserver {
		}
		for range terms {
		}
	})
	value := func(ch <-chan *clientv3.GetResponse, what string) string {
		t.Helper()
		select {
		case r, ok := <-ch:
			require.True(t, ok, "%s: channel closed", what)
			require.Equal(t, l.Key(), string(r.Kvs[0].Key), what)
			return string(r.Kvs[0].Value)
		case <-time.After(testTimeout):
			t.Fatalf("%s delivered nothing", what)
			return ""
		}
	}
	term := func() string {
		t.Helper()
		select {
		case tm, ok := <-terms:
			require.True(t, ok, "Terms: channel closed")
			require.NotNil(t, tm.Leader, "Terms reports no leader while one leads")
			require.Equal(t, l.Key(), string(tm.Leader.Key))
			return string(tm.Leader.Value)
		case <-time.After(testTimeout):
			t.Fatal("Terms delivered nothing")
			return ""
		}
	}
	require.Equal(t, "v2", value(byElection, "Election.Observe"))
	require.Equal(t, "v2", value(byObserver, "Observer.Observe"))
	require.Equal(t, "v2", term())
	require.NoError(t, l.Proclaim(ctx, "v3"))
	require.Equal(t, "v3", value(byElection, "Election.Observe"))
	require.Equal(t, "v3", value(byObserver, "Observer.Observe"))
	require.Equal(t, "v3", term())
	require.NoError(t, l.Resign(ctx))
}

// leaderAt returns the key and value of the election's leader at rev: the
// direct child NAME/<hex> with the lowest create revision.
func leaderAt(t *testing.T, cli *clientv3.Client, name string, rev int64) (key, value string) {
	t.Helper()
	resp, err := cli.Get(ctxT(t), name+"/", clientv3.WithPrefix(), clientv3.WithRev(rev),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	require.NoError(t, err)
	for _, kv := range resp.Kvs {
		if isHexChild(name+"/", string(kv.Key)) {
			return string(kv.Key), string(kv.Value)
		}
	}
	return "", ""
}

// Observe reports only leaders: each value it delivers is the leader's at
// the revision in its header, also when a stalled link hands it, at once,
// everything that happened while no leader was known (a nested key written,
// two candidates, a key outside the election, the first candidate resigned)
// (etcd-io/etcd#18163: etcd's Observe, waiting for a first leader, takes the
// first PUT under the prefix: here the nested key, which it reports as the
// leader).
func TestObserveAfterStallReportsOnlyLeaders(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const name = "obs-stall"
	p := faults.Proxy(t, c)
	cnt := counter{created: make(chan struct{}, 16)}
	ocli := etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...)
	es := theirSession(t, ocli)
	octx, cancel := context.WithCancel(ctx)
	ours := etcdsync.NewObserver(ocli, name).Observe(octx)
	theirs := concurrency.NewElection(es, name).Observe(octx)
	t.Cleanup(func() {
		cancel()
		for range ours {
		}
		for range theirs {
		}
	})
	awaitCreated(t, cnt.created, 2, testTimeout, "the observers' watches")

	p.Blackhole(true)
	_, err := admin.Put(ctx, name+"/x/1", "nested")
	require.NoError(t, err)
	a := etcdsync.NewElection(session(t, admin), name)
	require.NoError(t, a.Campaign(ctx, "a"))
	b := etcdsync.NewElection(session(t, admin), name)
	bLeads := async(func() error { return b.Campaign(ctx, "b") })
	waitKeys(t, admin, name+"/", 3)
	_, err = admin.Put(ctx, name+"x", "outside")
	require.NoError(t, err)
	require.NoError(t, a.Resign(ctx))
	require.NoError(t, resultWithin(t, bLeads, testTimeout, "b's Campaign"))
	p.Blackhole(false)

	var last int64
	for v := ""; v != "b"; {
		select {
		case r, ok := <-ours:
			require.True(t, ok, "Observe's channel closed")
			rev := r.Header.Revision
			require.Greater(t, rev, last, "revision order")
			last = rev
			key, value := leaderAt(t, admin, name, rev)
			require.Equal(t, key, string(r.Kvs[0].Key), "reported as the leader at %d", rev)
			v = string(r.Kvs[0].Value)
			require.Equal(t, value, v, "the leader's value at %d", rev)
		case <-time.After(testTimeout):
			t.Fatal("Observe did not report b")
		}
	}

	select {
	case r, ok := <-theirs:
		require.True(t, ok, "etcd's Observe closed")
		require.Equal(t, name+"/x/1", string(r.Kvs[0].Key), "etcd's Observe reports the nested key as the leader")
	case <-time.After(testTimeout):
		t.Fatal("etcd's Observe delivered nothing")
	}
	require.NoError(t, b.Resign(ctx))
}

// termState is the state of an election: its leader's key with its create
// and mod revisions, or none (key "").
type termState struct {
	rev        int64 // where it began
	key        string
	create, md int64
	value      string
}

func (s termState) String() string {
	if s.key == "" {
		return fmt.Sprintf("@%d none", s.rev)
	}
	return fmt.Sprintf("@%d %s c%d m%d %q", s.rev, s.key, s.create, s.md, s.value)
}

func sameTermState(a, b termState) bool {
	return a.key == b.key && a.create == b.create && a.md == b.md
}

// historyOf replays the events of prefix from revision from+1 to to (the
// revision of a write under prefix) over the candidates at from, and returns each state at the revision it began,
// starting with the state at from.
func historyOf(t *testing.T, admin *clientv3.Client, prefix string, from, to int64) []termState {
	t.Helper()
	ctx := ctxT(t)
	resp, err := admin.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(from))
	require.NoError(t, err)
	cands := map[string]*mvccpb.KeyValue{}
	for _, kv := range resp.Kvs {
		if isHexChild(prefix, string(kv.Key)) {
			cands[string(kv.Key)] = kv
		}
	}
	leader := func(rev int64) termState {
		var best *mvccpb.KeyValue
		for _, kv := range cands {
			if best == nil || kv.CreateRevision < best.CreateRevision {
				best = kv
			}
		}
		if best == nil {
			return termState{rev: rev}
		}
		return termState{rev: rev, key: string(best.Key), create: best.CreateRevision, md: best.ModRevision, value: string(best.Value)}
	}
	states := []termState{leader(from)}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wch := admin.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(from+1))
	for from < to {
		wr, ok := <-wch
		require.True(t, ok, "history watch closed")
		require.NoError(t, wr.Err())
		evs := wr.Events
		for i := 0; i < len(evs); {
			rev := evs[i].Kv.ModRevision
			for ; i < len(evs) && evs[i].Kv.ModRevision == rev; i++ {
				ev := evs[i]
				if !isHexChild(prefix, string(ev.Kv.Key)) {
					continue
				}
				if ev.Type == mvccpb.DELETE {
					delete(cands, string(ev.Kv.Key))
				} else {
					cands[string(ev.Kv.Key)] = ev.Kv
				}
			}
			if rev > to {
				break
			}
			if st := leader(rev); !sameTermState(st, states[len(states)-1]) {
				states = append(states, st)
			}
		}
		// Not the header's revision: a catching-up watch gets its events in
		// batches whose headers carry the store's current revision.
		if len(evs) > 0 {
			from = max(from, evs[len(evs)-1].Kv.ModRevision)
		}
	}
	return states
}

// termsRecorder records what Terms reports until stopped.
type termsRecorder struct {
	mu     sync.Mutex
	got    []termState
	cancel context.CancelFunc
	done   chan struct{}
}

func recordTerms(o *etcdsync.Observer) *termsRecorder {
	ctx, cancel := context.WithCancel(context.Background())
	r := &termsRecorder{cancel: cancel, done: make(chan struct{})}
	ch := o.Terms(ctx)
	go func() {
		defer close(r.done)
		for tm := range ch {
			st := termState{rev: tm.Rev}
			if tm.Leader != nil {
				st.key, st.create, st.md, st.value = string(tm.Leader.Key), tm.Leader.CreateRevision, tm.Leader.ModRevision, string(tm.Leader.Value)
			}
			r.mu.Lock()
			r.got = append(r.got, st)
			r.mu.Unlock()
		}
	}()
	return r
}

func (r *termsRecorder) states() []termState {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// until waits until the last recorded state began at rev or later.
func (r *termsRecorder) until(t *testing.T, rev int64) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for {
		st := r.states()
		if len(st) > 0 && st[len(st)-1].rev >= rev {
			return
		}
		require.True(t, time.Now().Before(deadline), "Terms did not reach revision %d: %v", rev, st)
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *termsRecorder) stop() { r.cancel(); <-r.done }

// electionChurn campaigns, proclaims, resigns, tries, hands over and loses
// leases (revoked by an admin) at random on name through clients from
// newClient, for d.
func electionChurn(t *testing.T, seed uint64, newClient func() *clientv3.Client, admin *clientv3.Client, name string, d time.Duration) {
	t.Helper()
	ctx := ctxT(t)
	rng := rand.New(rand.NewPCG(seed, seed))
	type cand struct {
		s *etcdsync.Session
		e *etcdsync.Election
	}
	clis := []*clientv3.Client{newClient(), newClient()}
	newCand := func(i int) *cand {
		s, err := etcdsync.NewSession(clis[i%len(clis)], etcdsync.WithTTL(5*time.Second))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		return &cand{s: s, e: etcdsync.NewElection(s, name)}
	}
	cands := []*cand{newCand(0), newCand(1), newCand(2), newCand(3)}
	var wg sync.WaitGroup
	defer wg.Wait()
	end := time.Now().Add(d)
	for i := 0; time.Now().Before(end); i++ {
		k := rng.IntN(len(cands))
		c := cands[k]
		switch op := rng.IntN(8); op {
		case 0, 1: // campaign, bounded
			d := time.Duration(50+rng.IntN(300)) * time.Millisecond
			wg.Go(func() {
				cctx, cancel := context.WithTimeout(ctx, d)
				defer cancel()
				_ = c.e.Campaign(cctx, fmt.Sprintf("c%d-%d", k, i))
			})
		case 2:
			_ = c.e.Proclaim(ctx, fmt.Sprintf("p%d-%d", k, i))
		case 3:
			_ = c.e.Resign(ctx)
		case 4:
			_ = c.e.TryCampaign(ctx, fmt.Sprintf("t%d-%d", k, i))
		case 5:
			hctx, cancel := context.WithTimeout(ctx, time.Second)
			_ = c.e.Handover(hctx)
			cancel()
		case 6:
			if rng.IntN(4) == 0 {
				wg.Wait()
				_, _ = admin.Revoke(ctx, clientv3.LeaseID(c.s.Lease()))
				cands[k] = newCand(k)
			}
		case 7: // a non-candidate key under the name: nested, or not hex
			if rng.IntN(2) == 0 {
				_, _ = admin.Put(ctx, name+"/nested/"+fmt.Sprint(i), "x")
			} else {
				_, _ = admin.Put(ctx, name+"/zz"+fmt.Sprint(i), "x")
			}
		}
		time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
	}
}

func checkTermsAgainstHistory(t *testing.T, admin *clientv3.Client, rawPrefix string, got []termState, to int64) {
	t.Helper()
	require.NotEmpty(t, got)
	want := historyOf(t, admin, rawPrefix, got[0].rev, to)
	// Keys compare by their last part: a namespace strips its prefix from
	// the keys Terms reports.
	norm := func(s []termState) []string {
		var out []string
		for _, st := range s {
			st.key = st.key[strings.LastIndexByte(st.key, '/')+1:]
			out = append(out, st.String())
		}
		return out
	}
	require.Equal(t, norm(want), norm(got), "Terms differs from the history")
}

func TestTermsMatchHistoryUnderChurn(t *testing.T) {
	t.Parallel()
	type rig struct {
		name   string
		prefix string
		client func(t *testing.T, c *etcdtest.Cluster) func() *clientv3.Client
	}
	rigs := []rig{
		{"plain", "", func(t *testing.T, c *etcdtest.Cluster) func() *clientv3.Client {
			return func() *clientv3.Client { return c.Client(t) }
		}},
		{"namespace", "tenant/", func(t *testing.T, c *etcdtest.Cluster) func() *clientv3.Client {
			return func() *clientv3.Client {
				cli := c.Client(t)
				cli.KV = namespace.NewKV(cli.KV, "tenant/")
				cli.Watcher = namespace.NewWatcher(cli.Watcher, "tenant/")
				cli.Lease = namespace.NewLease(cli.Lease, "tenant/")
				return cli
			}
		}},
		{"grpcproxy", "", func(t *testing.T, c *etcdtest.Cluster) func() *clientv3.Client {
			addr := etcdtest.StartGRPCProxy(t, c.Endpoints())
			return func() *clientv3.Client { return etcdtest.NewClient(t, []string{addr}) }
		}},
	}
	for _, r := range rigs {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			c := single(t)
			admin := c.Client(t)
			newClient := r.client(t, c)
			name := "churn"
			rec := recordTerms(etcdsync.NewObserver(newClient(), name))
			// A second observer on its own client, started later.
			time.Sleep(100 * time.Millisecond)
			electionChurn(t, 7, newClient, admin, name, 3*time.Second)
			// A key no term looks at marks the end of the history.
			resp, err := admin.Put(ctxT(t), r.prefix+name+"/nested/end", "x")
			require.NoError(t, err)
			to := resp.Header.Revision
			rec.until(t, 0)
			time.Sleep(500 * time.Millisecond) // let Terms catch up to the end
			rec.stop()
			got := rec.states()
			t.Logf("%d states", len(got))
			checkTermsAgainstHistory(t, admin, r.prefix+name+"/", got, to)
		})
	}
}

// Terms across a restart of the member its client talks to (in a 3-member
// cluster): the terms that came and went while the member was down are
// reported from the history, in order, none missed.
func TestTermsAcrossMemberRestartMissNone(t *testing.T) {
	t.Parallel()
	c := three(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	m := c.Member(0)
	if m == c.Leader() {
		m = c.Member(1)
	}
	ocli := etcdtest.NewClient(t, []string{m.Endpoint()})
	rec := recordTerms(etcdsync.NewObserver(ocli, "restart-terms"))
	rec.until(t, 0)
	var es []*etcdsync.Election
	for i := range 3 {
		es = append(es, etcdsync.NewElection(session(t, admin), "restart-terms"))
		_ = i
	}
	require.NoError(t, es[0].Campaign(ctx, "a"))
	bLeads := campaignAsync(ctx, es[1], "b")
	waitKeys(t, admin, "restart-terms/", 2)
	c.Stop(m)
	require.NoError(t, es[0].Resign(ctx))
	require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"))
	require.NoError(t, es[1].Proclaim(ctx, "b2"))
	cLeads := campaignAsync(ctx, es[2], "c")
	waitKeys(t, admin, "restart-terms/", 2)
	require.NoError(t, es[1].Resign(ctx))
	require.NoError(t, resultWithin(t, cLeads, testTimeout, "c leads"))
	require.NoError(t, es[2].Resign(ctx))
	require.NoError(t, c.Restart(m))
	resp, err := admin.Put(ctx, "restart-terms/nested/end", "x")
	require.NoError(t, err)
	rec.until(t, resp.Header.Revision-1)
	time.Sleep(300 * time.Millisecond)
	rec.stop()
	checkTermsAgainstHistory(t, admin, "restart-terms/", rec.states(), resp.Header.Revision)
}

// partialBatchBreaker ends, once armed, the first watch stream that delivers
// a response whose header revision is past its last event (etcd sends a
// catching-up watcher its events in batches of 1000 revisions, each with the
// store's current revision in its header): once the reader has taken the
// batch's last value (processed closes), its next receive fails as a member
// that lost its raft leader fails a require-leader watch.
type partialBatchBreaker struct {
	armed     atomic.Bool
	lastValue chan string   // the value of the partial batch's last event
	processed chan struct{} // closed by the test once the reader has it
}

func (b *partialBatchBreaker) dial() grpc.DialOption {
	return faults.WrapStreams(faults.WatchMethod, func(s grpc.ClientStream) grpc.ClientStream { return &partialBatchStream{ClientStream: s, b: b} })
}

type partialBatchStream struct {
	grpc.ClientStream
	b        *partialBatchBreaker
	failNext bool
}

func (s *partialBatchStream) RecvMsg(m any) error {
	if s.failNext {
		select {
		case <-s.b.processed:
		case <-time.After(testTimeout):
		}
		return rpctypes.ErrGRPCNoLeader
	}
	err := s.ClientStream.RecvMsg(m)
	wr, ok := m.(*pb.WatchResponse)
	if err != nil || !ok || len(wr.Events) == 0 {
		return err
	}
	last := wr.Events[len(wr.Events)-1].Kv
	if wr.Header.Revision > last.ModRevision && s.b.armed.CompareAndSwap(true, false) {
		s.failNext = true
		s.b.lastValue <- string(last.Value)
	}
	return nil
}

// A Terms reader that fell behind, whose watch then catches up from an old
// revision (etcd sends the backlog in batches of 1000 revisions, each header
// carrying the store's current revision) and is ended by a lost raft leader
// after the first batch: no change is missed without a compaction; the
// terms after the first batch are still reported, from the history.
func TestTermsAfterPartialCatchUpBatchMissNone(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	br := &partialBatchBreaker{lastValue: make(chan string, 1), processed: make(chan struct{})}
	ocli := c.Client(t, br.dial())
	tctx, stop := context.WithCancel(ctx)
	defer stop()
	terms := etcdsync.NewObserver(ocli, "batch-terms").Terms(tctx)
	var got []termState
	next := func() termState {
		t.Helper()
		select {
		case tm, ok := <-terms:
			require.True(t, ok)
			st := termState{rev: tm.Rev}
			if tm.Leader != nil {
				st.key, st.create, st.md, st.value = string(tm.Leader.Key), tm.Leader.CreateRevision, tm.Leader.ModRevision, string(tm.Leader.Value)
			}
			got = append(got, st)
			return st
		case <-time.After(testTimeout):
			t.Fatal("no term")
		}
		return termState{}
	}
	require.Empty(t, next().key)
	a := etcdsync.NewElection(session(t, admin), "batch-terms")
	require.NoError(t, a.Campaign(ctx, "a"))
	require.Equal(t, "a", next().value)
	b := etcdsync.NewElection(session(t, admin), "batch-terms")
	bLeads := campaignAsync(ctx, b, "b")
	waitKeys(t, admin, "batch-terms/", 2)
	// The reader stops reading; the leader proclaims once (Terms blocks on
	// it), resigns, and the next leader proclaims 1200 values.
	require.NoError(t, a.Proclaim(ctx, "a2"))
	require.NoError(t, a.Resign(ctx))
	require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"))
	for i := range 1200 {
		require.NoError(t, b.Proclaim(ctx, fmt.Sprintf("b%d", i)))
	}
	end, err := admin.Put(ctx, "batch-terms/nested/end", "x")
	require.NoError(t, err)
	br.armed.Store(true)
	// The reader reads again, until the last value.
	batchEnd := ""
	for st := next(); st.value != "b1199"; st = next() {
		if batchEnd == "" {
			select {
			case batchEnd = <-br.lastValue:
				t.Logf("a partial batch ends with %q", batchEnd)
			default:
			}
		}
		if batchEnd != "" && st.value == batchEnd {
			close(br.processed)
		}
	}
	require.NotEmpty(t, batchEnd, "no partial batch was seen")
	stop()
	for range terms {
	}
	checkTermsAgainstHistory(t, admin, "batch-terms/", got, end.Header.Revision)
}
