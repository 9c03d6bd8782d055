package tests

import (
	"context"
	"errors"
	"fmt"
	"log"
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
