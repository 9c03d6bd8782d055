package tests

import (
	"context"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/etcdsync/etcdsync"
)

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
