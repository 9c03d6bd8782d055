// Command rwmutex shows etcdsync's RWMutex at work: writers update a
// two-key configuration (version and payload, written one after the other)
// under the write lock, while readers read both keys under the read lock.
// Readers hold together; a writer holds alone, so no reader ever sees a
// half-written configuration. It prints each hold and checks that every
// read was consistent and that readers did overlap, exiting non-zero if not.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS or ETCDCTL_ENDPOINTS (comma-separated) is set.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keys are this run's names, under a prefix of its own (so that runs
// against a real cluster neither meet nor leave anything behind).
type keys struct {
	lock, version, payload string
}

func keysUnder(prefix string) keys {
	return keys{lock: prefix + "config-lock", version: prefix + "config/version", payload: prefix + "config/payload"}
}

func main() {
	readers := flag.Int("readers", 4, "number of readers, each with its own session")
	writers := flag.Int("writers", 2, "number of writers, each with its own session")
	rounds := flag.Int("rounds", 4, "holds per reader and writer")
	ttl := flag.Duration("ttl", 10*time.Second, "session TTL")
	flag.Parse()
	if err := run(*readers, *writers, *rounds, *ttl); err != nil {
		log.Fatal(err)
	}
}

func run(readers, writers, rounds int, ttl time.Duration) (err error) {
	cli, closeAll, err := etcdsynctest.Connect()
	if err != nil {
		return err
	}
	defer closeAll()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	prefix := fmt.Sprintf("etcdsync-example/%s/", strconv.FormatInt(time.Now().UnixNano(), 36))
	fmt.Printf("this run's keys are under %s\n", prefix)
	k := keysUnder(prefix)
	defer func() { // whatever run returns
		dctx, dcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer dcancel()
		if _, derr := cli.Delete(dctx, prefix, clientv3.WithPrefix()); derr != nil {
			err = errors.Join(err, fmt.Errorf("cleaning up %s: %w", prefix, derr))
		}
	}()
	if _, err := cli.Txn(ctx).Then(clientv3.OpPut(k.version, "0"), clientv3.OpPut(k.payload, "payload of version 0")).Commit(); err != nil {
		return err
	}

	var reading, mostReading atomic.Int32
	var wg sync.WaitGroup
	errs := make(chan error, readers+writers)
	start := func(name string, f func() error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(); err != nil {
				errs <- fmt.Errorf("%s: %w", name, err)
			}
		}()
	}
	for i := 1; i <= writers; i++ {
		start(fmt.Sprintf("writer %d", i), func() error { return writer(ctx, cli, k, i, rounds, ttl) })
	}
	for i := 1; i <= readers; i++ {
		start(fmt.Sprintf("reader %d", i), func() error {
			return reader(ctx, cli, k, i, rounds, ttl, &reading, &mostReading)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return err
	}
	if readers > 1 && mostReading.Load() < 2 {
		return fmt.Errorf("readers never held together")
	}
	fmt.Printf("%d writes and %d consistent reads; up to %d readers held at once\n", writers*rounds, readers*rounds, mostReading.Load())
	return nil
}

// writer takes the write lock rounds times and writes the version, then the
// payload, each guarded by the hold.
func writer(ctx context.Context, cli *clientv3.Client, k keys, id, rounds int, ttl time.Duration) error {
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
	if err != nil {
		return err
	}
	defer s.Close()
	rw := etcdsync.NewRWMutex(s, k.lock)
	for r := 0; r < rounds; r++ {
		if err := rw.Lock(ctx); err != nil {
			return err
		}
		resp, err := rw.Do(ctx, clientv3.OpGet(k.version))
		if err != nil {
			return err
		}
		v, err := strconv.Atoi(string(resp.Responses[0].GetResponseRange().Kvs[0].Value))
		if err != nil {
			return err
		}
		if _, err := rw.Do(ctx, clientv3.OpPut(k.version, strconv.Itoa(v+1))); err != nil {
			return err
		}
		time.Sleep(5 * time.Millisecond) // half written: no reader may look now
		if _, err := rw.Do(ctx, clientv3.OpPut(k.payload, fmt.Sprintf("payload of version %d", v+1))); err != nil {
			return err
		}
		fmt.Printf("writer %d holds the write lock (fencing token %d): version %d -> %d\n", id, rw.Rev(), v, v+1)
		if err := rw.Unlock(ctx); err != nil {
			return err
		}
	}
	return nil
}

// reader takes the read lock rounds times and checks that the payload
// belongs to the version.
func reader(ctx context.Context, cli *clientv3.Client, k keys, id, rounds int, ttl time.Duration, reading, most *atomic.Int32) error {
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
	if err != nil {
		return err
	}
	defer s.Close()
	rw := etcdsync.NewRWMutex(s, k.lock)
	for r := 0; r < rounds; r++ {
		if err := rw.RLock(ctx); err != nil {
			return err
		}
		n := reading.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		resp, err := rw.Do(ctx, clientv3.OpGet(k.version), clientv3.OpGet(k.payload))
		if err != nil {
			return err
		}
		version := string(resp.Responses[0].GetResponseRange().Kvs[0].Value)
		payload := string(resp.Responses[1].GetResponseRange().Kvs[0].Value)
		if payload != "payload of version "+version {
			return fmt.Errorf("read version %s with %q: a writer was half done", version, payload)
		}
		fmt.Printf("reader %d holds the read lock with %d readers: version %s\n", id, n, version)
		time.Sleep(10 * time.Millisecond) // a while, so that readers overlap
		reading.Add(-1)
		if err := rw.RUnlock(ctx); err != nil {
			return err
		}
	}
	return nil
}
