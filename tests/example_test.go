package tests

// Runnable examples of every primitive, checked by their // Output: lines:
// Mutex, RWMutex, Semaphore, MultiLock, Election, Observer terms, handover,
// Barrier, DoubleBarrier, Group and Shards.

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// exampleEtcd starts an embedded etcd for an example; in your code, the
// client is one of your cluster.
func exampleEtcd() (*clientv3.Client, func()) {
	endpoints, stop, err := etcdsynctest.StartServer()
	if err != nil {
		log.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second})
	if err != nil {
		stop()
		log.Fatal(err)
	}
	return cli, func() { cli.Close(); stop() }
}

func ExampleMutex() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	m := etcdsync.NewMutex(s, "/jobs/nightly-report")
	if err := m.Lock(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("locked; fencing token > 0:", m.Rev() > 0)

	// Writes guarded by the hold run only while it is current.
	if _, err := m.Do(ctx, clientv3.OpPut("/jobs/nightly-report/last-run", "today")); err != nil {
		log.Fatal(err)
	}
	if err := m.Unlock(ctx); err != nil {
		log.Fatal(err)
	}
	_, err = m.Do(ctx, clientv3.OpPut("/jobs/nightly-report/last-run", "again"))
	fmt.Println("after Unlock:", err)
	// Output:
	// locked; fencing token > 0: true
	// after Unlock: etcdsync: not held: /jobs/nightly-report is not held by this value
}

func ExampleMutex_TryLock() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	a, _ := etcdsync.NewSession(cli)
	defer a.Close()
	b, _ := etcdsync.NewSession(cli)
	defer b.Close()
	if err := etcdsync.NewMutex(a, "cron/backup").Lock(ctx); err != nil {
		log.Fatal(err)
	}
	// The error names the holder's key and create revision, for the logs.
	err := etcdsync.NewMutex(b, "cron/backup").TryLock(ctx)
	fmt.Println("locked:", errors.Is(err, etcdsync.ErrLocked))
	// Output:
	// locked: true
}

// fencedStore stands for a resource outside etcd that remembers the highest
// fencing token it has seen and rejects writes carrying an older one.
type fencedStore struct{ highest int64 }

func (f *fencedStore) write(token int64, what string) error {
	if token < f.highest {
		return fmt.Errorf("rejected %q: token %d is older than %d", what, token, f.highest)
	}
	f.highest = token
	return nil
}

func ExampleMutex_Rev() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	store := &fencedStore{}

	s1, _ := etcdsync.NewSession(cli)
	defer s1.Close()
	old := etcdsync.NewMutex(s1, "/jobs/export")
	if err := old.Lock(ctx); err != nil {
		log.Fatal(err)
	}
	staleToken := old.Rev()
	fmt.Println(store.write(staleToken, "first holder"))

	// The first holder stalls (a long GC pause, say) and loses its lease;
	// here we revoke it to show the effect.
	if _, err := cli.Revoke(ctx, s1.Lease()); err != nil {
		log.Fatal(err)
	}
	s2, _ := etcdsync.NewSession(cli)
	defer s2.Close()
	next := etcdsync.NewMutex(s2, "/jobs/export")
	if err := next.Lock(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println(store.write(next.Rev(), "second holder"))

	// The first holder wakes up and writes with its old token: rejected.
	fmt.Println(store.write(staleToken, "first holder, after its pause") != nil)
	// Output:
	// <nil>
	// <nil>
	// true
}

func ExampleRWMutex() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	s1, _ := etcdsync.NewSession(cli)
	defer s1.Close()
	s2, _ := etcdsync.NewSession(cli)
	defer s2.Close()
	r1, r2 := etcdsync.NewRWMutex(s1, "/config/billing"), etcdsync.NewRWMutex(s2, "/config/billing")
	// Readers of two sessions hold at once.
	if err := r1.RLock(ctx); err != nil {
		log.Fatal(err)
	}
	if err := r2.RLock(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("two readers hold")

	// A writer waits for both; TryLock says so at once.
	w := etcdsync.NewRWMutex(s2, "/config/billing")
	fmt.Println("writer can lock now:", w.TryLock(ctx) == nil)
	r1.RUnlock(ctx)
	r2.RUnlock(ctx)
	if err := w.Lock(ctx); err != nil {
		log.Fatal(err)
	}
	// Writes guarded by the write hold.
	_, err := w.Do(ctx, clientv3.OpPut("/config/billing/doc", "v2"))
	fmt.Println("written:", err == nil)
	w.Unlock(ctx)
	// Output:
	// two readers hold
	// writer can lock now: false
	// written: true
}

func ExampleSemaphore() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	s1, _ := etcdsync.NewSession(cli)
	defer s1.Close()
	s2, _ := etcdsync.NewSession(cli)
	defer s2.Close()
	a := etcdsync.NewSemaphore(s1, "/downstream/connections", 3)
	b := etcdsync.NewSemaphore(s2, "/downstream/connections", 3)
	if err := a.Acquire(ctx, 2); err != nil {
		log.Fatal(err)
	}
	fmt.Println("2 more free:", b.TryAcquire(ctx, 2) == nil)
	fmt.Println("1 more free:", b.TryAcquire(ctx, 1) == nil)
	b.Release(ctx)

	// Every participant must agree on the capacity.
	c := etcdsync.NewSemaphore(s2, "/downstream/connections", 5)
	fmt.Println(errors.Is(c.Acquire(ctx, 1), etcdsync.ErrInvalidArgument))
	a.Release(ctx)
	// Output:
	// 2 more free: false
	// 1 more free: true
	// true
}

func ExampleMutex_Run() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	m := etcdsync.NewMutex(s, "/jobs/nightly-report")
	// fn runs only while the lock is held; its context is cancelled the
	// moment the hold ends, and the lock is released when fn returns.
	err = m.Run(ctx, func(ctx context.Context) error {
		_, token, _ := etcdsync.HoldFrom(ctx) // pass it to systems that fence
		fmt.Println("holding, token > 0:", token > 0)
		// A nested Run through ctx enters the same hold at once.
		return m.Run(ctx, func(ctx context.Context) error {
			_, inner, _ := etcdsync.HoldFrom(ctx)
			fmt.Println("nested, same token:", inner == token)
			return nil
		})
	})
	fmt.Println("released:", err, m.Key() == "")
	// Output:
	// holding, token > 0: true
	// nested, same token: true
	// released: <nil> true
}

func ExampleElection_Run() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	s, err := etcdsync.NewSession(cli)
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	e := etcdsync.NewElection(s, "/services/billing/leader")
	// A leader-only loop: it starts once this candidate leads and must stop
	// when its context ends (context.Cause says why leadership ended).
	err = e.Run(ctx, "host-a:8080", func(ctx context.Context) error {
		for i := 1; i <= 3; i++ {
			if err := e.Proclaim(ctx, fmt.Sprintf("host-a:8080, round %d", i)); err != nil {
				return err
			}
		}
		fmt.Println("led three rounds")
		return nil // Run resigns
	})
	fmt.Println("resigned:", err, e.Key() == "")
	// Output:
	// led three rounds
	// resigned: <nil> true
}

// Two transfers name the same two accounts in opposite orders. Each holds
// both accounts or waits; neither waits for the other in a circle.
func ExampleMultiLock() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var mu sync.Mutex
	balance := map[string]int64{"alice": 100, "bob": 100}
	transfer := func(from, to string, amount int64) {
		s, err := etcdsync.NewSession(cli)
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close()
		ml := etcdsync.NewMultiLock(s, "/accounts/"+from, "/accounts/"+to)
		err = ml.Run(ctx, func(ctx context.Context) error {
			// Both keys were written at one revision: one fencing token.
			if ml.Rev("/accounts/"+from) != ml.Rev("/accounts/"+to) {
				return fmt.Errorf("two tokens")
			}
			mu.Lock()
			defer mu.Unlock()
			balance[from] -= amount
			balance[to] += amount
			return nil
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for range 5 {
		wg.Go(func() { transfer("alice", "bob", 10) })
		wg.Go(func() { transfer("bob", "alice", 3) })
	}
	wg.Wait()
	fmt.Println("alice:", balance["alice"], "bob:", balance["bob"])
	// Output:
	// alice: 65 bob: 135
}

// A pool of workers: each joins with its address; a dispatcher watches who
// is in. A worker whose session ends (here closed; a crashed one when its
// lease expires) leaves by itself.
func ExampleGroup() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var workers []*etcdsync.Session
	for _, addr := range []string{"10.0.0.1:8080", "10.0.0.2:8080"} {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close()
		if err := etcdsync.NewGroup(s, "/pools/render").Join(ctx, addr); err != nil {
			log.Fatal(err)
		}
		workers = append(workers, s)
	}

	// The dispatcher needs no Session to read or watch the pool.
	members, _, err := etcdsync.GroupMembers(ctx, cli, "/pools/render")
	if err != nil {
		log.Fatal(err)
	}
	for _, m := range members {
		fmt.Println("in the pool:", string(m.Value))
	}
	views, err := etcdsync.WatchGroup(ctx, cli, "/pools/render")
	if err != nil {
		log.Fatal(err)
	}
	workers[0].Close()
	for v := range views { // each view is the whole pool at v.Rev
		if len(v.Members) == 1 {
			fmt.Println("left in the pool:", string(v.Members[0].Value))
			break
		}
	}
	// Output:
	// in the pool: 10.0.0.1:8080
	// in the pool: 10.0.0.2:8080
	// left in the pool: 10.0.0.2:8080
}

// A coordinator holds workers at a barrier until the input is ready. With
// HoldFor the barrier is bound to the coordinator's session: if the
// coordinator crashed, its lease would expire and the workers would go on
// rather than wait forever.
func ExampleBarrier() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	gate := etcdsync.NewBarrier(cli, "/jobs/import/input-ready")
	if err := gate.HoldFor(ctx, s); err != nil {
		log.Fatal(err)
	}

	var wg sync.WaitGroup
	var ready atomic.Bool
	var early atomic.Int32
	for range 3 {
		wg.Go(func() {
			if err := etcdsync.NewBarrier(cli, "/jobs/import/input-ready").Wait(ctx); err != nil {
				log.Fatal(err)
			}
			if !ready.Load() {
				early.Add(1)
			}
		})
	}
	ready.Store(true) // the input is written
	if err := gate.Release(ctx); err != nil {
		log.Fatal(err)
	}
	wg.Wait()
	fmt.Println("workers that went before the release:", early.Load())
	// Output:
	// workers that went before the release: 0
}

// Three workers start a phase together and finish it together: none starts
// before all three have entered, and none goes on before all three are done.
// Each worker is a Session: one that crashed would no longer count, so it
// would not hold the others past its lease.
func ExampleDoubleBarrier() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	const workers = 3
	var entered, done atomic.Int32
	var startedEarly, leftEarly atomic.Bool
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
			if err != nil {
				log.Fatal(err)
			}
			defer s.Close()
			phase := etcdsync.NewDoubleBarrier(s, "/jobs/import/phase", workers)
			entered.Add(1)
			if err := phase.Enter(ctx); err != nil {
				log.Fatal(err)
			}
			if entered.Load() < workers {
				startedEarly.Store(true)
			}
			// ... the phase's work ...
			done.Add(1)
			if err := phase.Leave(ctx); err != nil {
				log.Fatal(err)
			}
			if done.Load() < workers {
				leftEarly.Store(true)
			}
		})
	}
	wg.Wait()
	fmt.Println("a worker started before all entered:", startedEarly.Load())
	fmt.Println("a worker went on before all were done:", leftEarly.Load())
	// Output:
	// a worker started before all entered: false
	// a worker went on before all were done: false
}

// Watch the terms of an election, "no leader" included: a dashboard or an
// alert on a leader-only service that has nobody running it.
func ExampleObserver_Terms() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	terms := etcdsync.NewObserver(cli, "/services/indexer-leader").Terms(ctx)
	show := func() {
		if t := <-terms; t.Leader == nil {
			fmt.Println("no leader")
		} else {
			fmt.Printf("leader: %s\n", t.Leader.Value)
		}
	}
	show() // the state when it starts

	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	e := etcdsync.NewElection(s, "/services/indexer-leader")
	if err := e.Campaign(ctx, "host-a"); err != nil {
		log.Fatal(err)
	}
	show()
	if err := e.Resign(ctx); err != nil {
		log.Fatal(err)
	}
	show() // nobody was queued behind host-a
	// Output:
	// no leader
	// leader: host-a
	// no leader
}

// Step down on shutdown (SIGTERM in a rolling deploy): Handover stops the
// work under Run, resigns once it has returned, and the next candidate leads
// at once instead of after the TTL.
func ExampleElection_Handover() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	newCandidate := func() (*etcdsync.Election, func() error) {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(60*time.Second))
		if err != nil {
			log.Fatal(err)
		}
		return etcdsync.NewElection(s, "/services/indexer-leader"), s.Close
	}
	a, closeA := newCandidate() // host-a
	defer closeA()
	b, closeB := newCandidate() // host-b, another process in real life
	defer closeB()

	working := make(chan struct{})
	ran := make(chan error)
	go func() {
		ran <- a.Run(ctx, "host-a", func(ctx context.Context) error {
			close(working)
			<-ctx.Done() // the leader-only loop, until told to stop
			fmt.Println("host-a: work stopped:", errors.Is(context.Cause(ctx), etcdsync.ErrLockReleased))
			return nil
		})
	}()
	<-working
	bLeads := make(chan error)
	go func() { bLeads <- b.Campaign(ctx, "host-b") }()

	// SIGTERM arrives at host-a.
	if err := a.Handover(ctx); err != nil {
		log.Fatal(err)
	}
	if err := <-ran; err != nil {
		log.Fatal(err)
	}
	if err := <-bLeads; err != nil {
		log.Fatal(err)
	}
	fmt.Println("host-b leads")
	// Output:
	// host-a: work stopped: true
	// host-b leads
}

// Run a job only if nobody runs it now, without queuing: TryRun returns
// ErrLocked at once (one RPC, nothing written) when the lock is taken.
func ExampleMutex_TryRun() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	newMutex := func() (*etcdsync.Mutex, func() error) {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
		if err != nil {
			log.Fatal(err)
		}
		return etcdsync.NewMutex(s, "/jobs/reindex"), s.Close
	}
	other, closeOther := newMutex() // another process, in real life
	mine, closeMine := newMutex()
	defer closeMine()
	reindex := func(ctx context.Context) error {
		fmt.Println("reindexing")
		return nil
	}

	if err := other.Lock(ctx); err != nil {
		log.Fatal(err)
	}
	err := mine.TryRun(ctx, reindex)
	fmt.Println("locked:", errors.Is(err, etcdsync.ErrLocked))
	closeOther() // the other process ends
	if err := mine.TryRun(ctx, reindex); err != nil {
		log.Fatal(err)
	}
	// Output:
	// locked: true
	// reindexing
}

// Four shards of work (say, partitions of a queue) shared by the members
// that run them: each shard on one member at a time, its fn's context
// carrying the shard's fencing token. Here one member runs them all; a
// second member's Run would take two of them over.
func ExampleShards() {
	cli, stop := exampleEtcd()
	defer stop()
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	var mu sync.Mutex
	ran := map[int]bool{}
	all := make(chan struct{})
	work := func(ctx context.Context, shard int) error {
		// Fence the shard's writes with its token: a write commits only
		// while this member holds the shard.
		key, token, _ := etcdsync.HoldFrom(ctx)
		_, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", token)).
			Then(clientv3.OpPut(fmt.Sprintf("/reports/%d", shard), "done")).Commit()
		if err != nil {
			return err // logged and counted; the shard's fn runs again after a pause
		}
		mu.Lock()
		if !ran[shard] {
			if ran[shard] = true; len(ran) == 4 {
				close(all)
			}
		}
		mu.Unlock()
		<-ctx.Done() // work until the shard moves to another member, or Run ends
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- etcdsync.NewShards(s, "/jobs/partitions", 4).Run(ctx, work) }()
	<-all

	// A dashboard needs no Session to see who holds which shard.
	owners, err := etcdsync.ShardOwners(context.Background(), cli, "/jobs/partitions", 4)
	if err != nil {
		log.Fatal(err)
	}
	for i, o := range owners {
		fmt.Printf("shard %d held by this member: %v\n", i, o.Held && o.Lease == s.Lease())
	}
	cancel()
	fmt.Println("Run returned with its context:", errors.Is(<-done, context.Canceled))
	// Output:
	// shard 0 held by this member: true
	// shard 1 held by this member: true
	// shard 2 held by this member: true
	// shard 3 held by this member: true
	// Run returned with its context: true
}
