// Command shards shows etcdsync's Shards at work: 3 workers, each with its
// own Session, share 12 shards; a 4th joins and takes 3 of them, one from
// each; then one stops and the others share its shards. Each worker's fn
// runs while its shard is held, and says so in a table of who runs which
// shard; the example prints that table, checked against ShardOwners (what
// etcd says, with each shard's fencing token), each time the assignment has
// settled, with the shards that moved.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS or ETCDCTL_ENDPOINTS (comma-separated) is set.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	name   = "etcdsync-example/shards"
	shards = 12
)

// worker is one member: its session, and its Run.
type worker struct {
	id   string
	s    *etcdsync.Session
	stop context.CancelFunc
	done chan error // Run's result
}

// table is who runs which shard, as the workers' fns say: they set it when
// they start and clear it when they stop. changed gets a tick at each
// change.
type table struct {
	mu      sync.Mutex
	runs    [shards]string // the worker running each shard, or ""
	changed chan struct{}
}

func (t *table) set(shard int, id string) {
	t.mu.Lock()
	t.runs[shard] = id
	t.mu.Unlock()
	select {
	case t.changed <- struct{}{}:
	default:
	}
}

func (t *table) snapshot() [shards]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.runs
}

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	cli, closeAll, err := etcdsynctest.Connect()
	if err != nil {
		return err
	}
	defer closeAll()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	t := &table{changed: make(chan struct{}, 1)}
	var workers []*worker
	defer func() { // on an early return: stop every worker and wait for it
		for _, w := range workers {
			w.stop()
			<-w.done
			w.s.Close()
		}
	}()
	join := func(id string) error {
		s, err := etcdsync.NewSession(cli)
		if err != nil {
			return err
		}
		rctx, stop := context.WithCancel(ctx)
		w := &worker{id: id, s: s, stop: stop, done: make(chan error, 1)}
		workers = append(workers, w)
		sh := etcdsync.NewShards(s, name, shards)
		go func() {
			w.done <- sh.Run(rctx, func(ctx context.Context, shard int) error {
				t.set(shard, id)
				<-ctx.Done() // the work: until the shard moves, is lost, or Run ends
				t.set(shard, "")
				return nil
			})
		}()
		return nil
	}
	leave := func(id string) error {
		i := slices.IndexFunc(workers, func(w *worker) bool { return w.id == id })
		w := workers[i]
		workers = slices.Delete(workers, i, i+1)
		w.stop()
		err := <-w.done
		w.s.Close()
		if !errors.Is(err, context.Canceled) {
			return fmt.Errorf("%s's Run: %w", id, err)
		}
		return nil
	}

	for _, id := range []string{"w1", "w2", "w3"} {
		if err := join(id); err != nil {
			return err
		}
	}
	fmt.Printf("w1, w2 and w3 join %d shards\n", shards)
	before, err := settled(ctx, cli, t, workers, [shards]string{})
	if err != nil {
		return err
	}

	fmt.Println("w4 joins")
	if err := join("w4"); err != nil {
		return err
	}
	if before, err = settled(ctx, cli, t, workers, before); err != nil {
		return err
	}

	fmt.Println("w2 stops")
	if err := leave("w2"); err != nil {
		return err
	}
	if _, err = settled(ctx, cli, t, workers, before); err != nil {
		return err
	}

	for len(workers) > 0 {
		if err := leave(workers[0].id); err != nil {
			return err
		}
	}
	resp, err := cli.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return err
	}
	if resp.Count != 0 {
		return fmt.Errorf("%d keys left under %s", resp.Count, name)
	}
	fmt.Printf("all stopped; no key left under %s\n", name)
	return nil
}

// settled waits until the workers' fns run every shard, each worker
// floor or ceil of its share, and ShardOwners says the same; then it
// prints the shards that moved since before, and who runs which shard
// with its fencing token. It returns the assignment.
func settled(ctx context.Context, cli *clientv3.Client, t *table, workers []*worker, before [shards]string) ([shards]string, error) {
	for {
		now := t.snapshot()
		if balanced(now, workers) {
			owners, err := etcdsync.ShardOwners(ctx, cli, name, shards)
			if err != nil {
				return now, err
			}
			if agree(now, owners, workers) {
				printTable(now, owners, workers, before)
				return now, nil
			}
		}
		select {
		case <-t.changed:
		case <-ctx.Done():
			return now, fmt.Errorf("the shards did not settle: %v (running: %q)", ctx.Err(), now)
		}
	}
}

// balanced reports whether every shard runs on one of workers, each
// running shards/len(workers) shards, rounded down or up.
func balanced(runs [shards]string, workers []*worker) bool {
	count := map[string]int{}
	for _, id := range runs {
		count[id]++
	}
	low := shards / len(workers)
	for _, w := range workers {
		if k := count[w.id]; k < low || k > low+1 {
			return false
		}
		delete(count, w.id)
	}
	return len(count) == 0 // no shard idle, none on a worker that left
}

// agree reports whether etcd's holder of each shard is the worker whose fn
// runs it.
func agree(runs [shards]string, owners []etcdsync.Entry, workers []*worker) bool {
	for i, o := range owners {
		j := slices.IndexFunc(workers, func(w *worker) bool { return w.s.Lease() == o.Lease })
		if !o.Held || j < 0 || workers[j].id != runs[i] {
			return false
		}
	}
	return true
}

// printTable prints the shards that moved since before, then each worker's
// shards with their fencing tokens.
func printTable(runs [shards]string, owners []etcdsync.Entry, workers []*worker, before [shards]string) {
	for i := range runs {
		if before[i] != "" && before[i] != runs[i] {
			fmt.Printf("  shard %d moved from %s to %s\n", i, before[i], runs[i])
		}
	}
	for _, w := range workers {
		var held []string
		for i, id := range runs {
			if id == w.id {
				held = append(held, fmt.Sprintf("%d (token %d)", i, owners[i].Rev))
			}
		}
		fmt.Printf("  %s runs %s\n", w.id, strings.Join(held, ", "))
	}
}
