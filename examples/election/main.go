// Command election shows etcdsync's Election at work with Election.Run:
// three candidates each run a leader-only loop that Run starts once they
// lead and stops (its context cancelled, with the cause) the moment they do
// not. The leader proclaims a few reports, then "crashes" (orphans its
// session without resigning) and the example prints who took over and how
// long failover took; that leader then steps down (its loop returns, Run
// resigns) and the last candidate takes over within a round trip.
//
// An Observer follows the election from before anyone campaigns to the end.
// Its lines are printed at each step, once it has seen that step's last
// report, so they come in order with the rest.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS or ETCDCTL_ENDPOINTS (comma-separated) is set.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"sync"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const (
	name    = "etcdsync-example/leader"
	reports = 3 // proclaimed by each leader before it waits to step down
)

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
	cli, closeAll, err := etcdsynctest.Connect()
	if err != nil {
		return err
	}
	defer closeAll()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// The observer needs no session. It says who leads, then starts
	// observing, before any candidate has a session.
	obs := etcdsync.NewObserver(cli, name)
	if err := printLeader(ctx, obs); err != nil {
		return err
	}
	octx, ocancel := context.WithCancel(ctx)
	seen := obs.Observe(octx)
	defer func() { // on an early return: stop the observer and wait for it
		ocancel()
		for range seen {
		}
	}()

	started := make(chan leads, 3)
	var runs sync.WaitGroup
	defer func() { cancel(); runs.Wait() }() // on an early return: end every Run
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
		runs.Go(func() { c.done <- c.election.Run(ctx, c.id+" is leading", c.lead(started)) })
		if id == "alpha" { // alpha leads first, the others queue behind it
			first, err := next(ctx, started)
			if err != nil {
				return err
			}
			fmt.Printf("%s leads (term %d)\n", first.c.id, first.term)
		}
	}
	alpha := cands[0]
	if err := observed(ctx, seen, alpha); err != nil {
		return err
	}

	fmt.Printf("alpha crashes without resigning (its lease expires %v after its last keepalive, the TTL %v and the slack %v, and the server checks expiries every 500ms)\n",
		alpha.session.TTL()+alpha.session.Slack(), alpha.session.TTL(), alpha.session.Slack())
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
	if err := observed(ctx, seen, second.c); err != nil {
		return err
	}

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
	if err := observed(ctx, seen, last.c); err != nil {
		return err
	}
	close(last.c.stepDown)
	if err := <-last.c.done; err != nil {
		return err
	}
	fmt.Printf("%s stepped down\n", last.c.id)

	// The observer has printed every value. A leader's end is not a value:
	// it stops, prints anything it still had (nothing is expected), and
	// asks who leads now.
	ocancel()
	for resp := range seen {
		printObserved(resp)
	}
	if err := printLeader(ctx, obs); err != nil {
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
// then proclaims a report every 100 ms, up to reports of them, until it is
// told to step down or its leadership ends (its context is cancelled;
// context.Cause says why).
func (c *candidate) lead(started chan<- leads) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		_, term, _ := etcdsync.HoldFrom(ctx) // the term's fencing token
		started <- leads{c, term}
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		ticks := tick.C
		for i := 1; ; i++ {
			select {
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-c.stepDown:
				return nil
			case <-ticks:
				if err := c.election.Proclaim(ctx, fmt.Sprintf("%s: report %d", c.id, i)); err != nil {
					return err
				}
				if i == reports {
					ticks = nil // done reporting: wait to step down
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

// observed prints what the observer delivered, in order, up to c's last
// report. It blocks until then or until ctx ends.
func observed(ctx context.Context, seen <-chan *clientv3.GetResponse, c *candidate) error {
	want := fmt.Sprintf("%s: report %d", c.id, reports)
	for {
		select {
		case resp, ok := <-seen:
			if !ok {
				return fmt.Errorf("the observer stopped before %q", want)
			}
			printObserved(resp)
			if string(resp.Kvs[0].Value) == want {
				return nil
			}
		case <-ctx.Done():
			return fmt.Errorf("the observer did not see %q: %w", want, ctx.Err())
		}
	}
}

func printObserved(resp *clientv3.GetResponse) {
	fmt.Printf("  observer: leader %s says %q (revision %d)\n", resp.Kvs[0].Key, resp.Kvs[0].Value, resp.Header.Revision)
}

// printLeader prints who leads now, by asking once.
func printLeader(ctx context.Context, obs *etcdsync.Observer) error {
	resp, err := obs.Leader(ctx)
	switch {
	case errors.Is(err, etcdsync.ErrElectionNoLeader):
		fmt.Println("  observer: no leader")
		return nil
	case err != nil:
		return err
	}
	printObserved(resp)
	return nil
}
