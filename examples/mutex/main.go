// Command mutex shows etcdsync's Mutex at work: N workers, each with its own
// Session, take turns on one lock and increment a counter stored in etcd with
// a guarded transaction. It prints each hold (worker, fencing token, time
// waited) and checks the final count, exiting non-zero if it is wrong.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS or ETCDCTL_ENDPOINTS (comma-separated) is set,
// and says which it used. Its keys live under a prefix of their own for each
// run (etcdsync-example/<run>/), deleted again when it ends, also on error.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

func main() {
	workers := flag.Int("workers", 4, "number of workers, each with its own session")
	rounds := flag.Int("rounds", 5, "holds per worker")
	ttl := flag.Duration("ttl", 10*time.Second, "session TTL")
	flag.Parse()
	if err := run(*workers, *rounds, *ttl); err != nil {
		log.Fatal(err)
	}
}

func run(workers, rounds int, ttl time.Duration) error {
	cli, closeAll, err := etcdsynctest.Connect()
	if err != nil {
		return err
	}
	defer closeAll()
	prefix := fmt.Sprintf("etcdsync-example/%s/", strconv.FormatInt(time.Now().UnixNano(), 36))
	lockName, counterKey := prefix+"lock", prefix+"counter"
	fmt.Printf("this run's keys are under %s\n", prefix)
	defer cleanUp(cli, prefix)
	// Interrupted, the workers stop and the keys are cleaned up all the same.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if _, err := cli.Put(ctx, counterKey, "0"); err != nil {
		return err
	}

	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 1; w <= workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := worker(ctx, cli, lockName, counterKey, w, rounds, ttl); err != nil {
				errs <- fmt.Errorf("worker %d: %w", w, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return err
	}

	resp, err := cli.Get(ctx, counterKey)
	if err != nil {
		return err
	}
	got, want := string(resp.Kvs[0].Value), strconv.Itoa(workers*rounds)
	if got != want {
		return fmt.Errorf("counter is %s, want %s: mutual exclusion failed", got, want)
	}
	fmt.Printf("counter = %s = %d workers x %d rounds: every increment ran under the lock\n", got, workers, rounds)
	return nil
}

// cleanUp deletes every key under prefix. It runs after the workers have
// closed their sessions (so their lock keys are gone already), under a
// context of its own: the run's may have ended.
func cleanUp(cli *clientv3.Client, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := cli.Delete(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		log.Printf("cleaning up %s: %v", prefix, err)
		return
	}
	fmt.Printf("cleaned up: deleted what this run left under %s (%d keys)\n", prefix, resp.Deleted)
}

// worker takes the lock rounds times and increments the counter under it.
func worker(ctx context.Context, cli *clientv3.Client, lockName, counterKey string, id, rounds int, ttl time.Duration) error {
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
	if err != nil {
		return err
	}
	defer s.Close()
	m := etcdsync.NewMutex(s, lockName)
	for r := 0; r < rounds; r++ {
		start := time.Now()
		if err := m.Lock(ctx); err != nil {
			return err
		}
		waited := time.Since(start)
		resp, err := cli.Get(ctx, counterKey)
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(string(resp.Kvs[0].Value))
		if err != nil {
			return err
		}
		// The put runs only while this hold is current.
		if _, err := m.Do(ctx, clientv3.OpPut(counterKey, strconv.Itoa(n+1))); err != nil {
			return err
		}
		fmt.Printf("worker %d holds %s (fencing token %d, waited %v): counter %d -> %d\n",
			id, lockName, m.Rev(), waited.Round(time.Millisecond), n, n+1)
		if err := m.Unlock(ctx); err != nil {
			return err
		}
	}
	return nil
}
