// Command semaphore shows etcdsync's Semaphore at work: workers, each with
// its own Session, share a pool of permits (say, connections a downstream
// service accepts). Each job asks for 1 to 3 permits; the permits in use
// never exceed the capacity, and requests are served in arrival order. It
// prints each hold and checks the bound, exiting non-zero if it was broken.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS or ETCDCTL_ENDPOINTS (comma-separated) is set.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
)

const semName = "etcdsync-example/downstream-connections"

func main() {
	workers := flag.Int("workers", 5, "number of workers, each with its own session")
	capacity := flag.Int64("capacity", 4, "permits in the pool")
	jobs := flag.Int("jobs", 4, "jobs per worker")
	ttl := flag.Duration("ttl", 10*time.Second, "session TTL")
	flag.Parse()
	if err := run(*workers, *capacity, *jobs, *ttl); err != nil {
		log.Fatal(err)
	}
}

func run(workers int, capacity int64, jobs int, ttl time.Duration) error {
	cli, closeAll, err := etcdsynctest.Connect()
	if err != nil {
		return err
	}
	defer closeAll()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	var inUse, most atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 1; w <= workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			sem := etcdsync.NewSemaphore(s, semName, capacity)
			for j := 0; j < jobs; j++ {
				n := int64((w+j)%3 + 1)
				if err := sem.Acquire(ctx, n); err != nil {
					errs <- fmt.Errorf("worker %d: %w", w, err)
					return
				}
				u := inUse.Add(n)
				for m := most.Load(); u > m && !most.CompareAndSwap(m, u); m = most.Load() {
				}
				fmt.Printf("worker %d holds %d permits (fencing token %d); %d of %d in use\n", w, n, sem.Rev(), u, capacity)
				time.Sleep(20 * time.Millisecond) // the job
				inUse.Add(-n)
				if err := sem.Release(ctx); err != nil {
					errs <- fmt.Errorf("worker %d: %w", w, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return err
	}
	if most.Load() > capacity {
		return fmt.Errorf("%d permits in use at once, capacity %d", most.Load(), capacity)
	}
	fmt.Printf("%d jobs done; at most %d of %d permits in use at once\n", workers*jobs, most.Load(), capacity)
	return nil
}
