// Command election shows etcdsync's Election at work with Election.Run:
// three candidates each run a leader-only loop that Run starts once they
// lead and stops (its context cancelled, with the cause) the moment they do
// not. The leader proclaims a few values that an observer prints, then
// "crashes" (orphans its session without resigning) and the example prints
// who took over and how long failover took; that leader then steps down (its
// loop returns, Run resigns) and the last candidate takes over within a
// round trip.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS (comma-separated) is set.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const name = "etcdsync-example/leader"

type candidate struct {
	id       string
	session  *etcdsync.Session
	election *etcdsync.Election
	stepDown chan struct{} // closed: end the leader-only loop (Run then resigns)
	done     chan error    // Run's result
}

// leads reports a candidate that began to lead, with its term.
type leads struct {
	c    *candidate
	term int64
}

func main() {
	ttl := flag.Duration("ttl", 2*time.Second, "session TTL: how long a crashed leader keeps leading")
	flag.Parse()
	if err := run(*ttl); err != nil {
		log.Fatal(err)
	}
}

func run(ttl time.Duration) error {
	cli, closeAll, err := etcdtest.Connect()
	if err != nil {
		return err
	}
	defer closeAll()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// An observer with a session of its own prints every leader and value.
	obsSession, err := etcdsync.NewSession(cli)
	if err != nil {
		return err
	}
	defer obsSession.Close()
	octx, ocancel := context.WithCancel(ctx)
	observed := make(chan struct{})
	go func() {
		defer close(observed)
		for resp := range etcdsync.NewElection(obsSession, name).Observe(octx) {
			fmt.Printf("  observer: leader %s says %q (revision %d)\n", resp.Kvs[0].Key, resp.Kvs[0].Value, resp.Header.Revision)
		}
	}()
	defer func() { ocancel(); <-observed }()

	started := make(chan leads, 3)
	var cands []*candidate
	for _, id := range []string{"alpha", "beta", "gamma"} {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
		if err != nil {
			return err
		}
		defer s.Close()
		c := &candidate{id: id, session: s, election: etcdsync.NewElection(s, name),
			stepDown: make(chan struct{}), done: make(chan error, 1)}
		cands = append(cands, c)
		go func() { c.done <- c.election.Run(ctx, c.id+" is leading", c.lead(started)) }()
		if id == "alpha" { // alpha leads first, the others queue behind it
			if _, err := next(ctx, started); err != nil {
				return err
			}
		}
	}
	alpha := cands[0]
	time.Sleep(300 * time.Millisecond) // let alpha's loop report a few times

	fmt.Printf("alpha crashes without resigning (its lease expires within %v)\n", ttl)
	crashed := time.Now()
	alpha.session.Orphan()
	if err := <-alpha.done; !errors.Is(err, etcdsync.ErrSessionClosed) {
		return fmt.Errorf("alpha's Run returned %v, want its session's end", err)
	}
	fmt.Println("alpha's loop stopped: its context ended with its session")
	second, err := next(ctx, started)
	if err != nil {
		return err
	}
	fmt.Printf("%s took over after %v (term %d)\n", second.c.id, time.Since(crashed).Round(time.Millisecond), second.term)

	time.Sleep(200 * time.Millisecond)
	resigned := time.Now()
	close(second.c.stepDown)
	if err := <-second.c.done; err != nil {
		return err
	}
	last, err := next(ctx, started)
	if err != nil {
		return err
	}
	fmt.Printf("%s stepped down; %s took over after %v (term %d)\n", second.c.id, last.c.id, time.Since(resigned).Round(time.Millisecond), last.term)
	close(last.c.stepDown)
	if err := <-last.c.done; err != nil {
		return err
	}
	resp, err := cli.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return err
	}
	if resp.Count != 0 {
		return fmt.Errorf("%d candidate keys left behind", resp.Count)
	}
	fmt.Println("all stepped down; no candidate key left")
	return nil
}

// lead returns the candidate's leader-only loop: it reports that it leads,
// then proclaims a report every 100 ms until it is told to step down or its
// leadership ends (its context is cancelled; context.Cause says why).
func (c *candidate) lead(started chan<- leads) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		_, term, _ := etcdsync.HoldFrom(ctx) // the term's fencing token
		fmt.Printf("%s leads (term %d)\n", c.id, term)
		started <- leads{c, term}
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for i := 1; ; i++ {
			select {
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-c.stepDown:
				return nil
			case <-tick.C:
				if err := c.election.Proclaim(ctx, fmt.Sprintf("%s: report %d", c.id, i)); err != nil {
					return err
				}
			}
		}
	}
}

// next waits for the next candidate to lead.
func next(ctx context.Context, started <-chan leads) (leads, error) {
	select {
	case l := <-started:
		return l, nil
	case <-ctx.Done():
		return leads{}, ctx.Err()
	}
}
