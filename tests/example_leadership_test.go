package tests

// Leadership as services run it: terms with "no leader", a handover on
// shutdown, try forms.

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/etcdsync/etcdsync"
)

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
