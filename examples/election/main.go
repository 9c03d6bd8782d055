// Command election shows etcdsync's Election at work: three candidates
// campaign, the leader proclaims a few values that an observer prints, then
// the leader "crashes" (orphans its session without resigning) and the
// example prints who took over and how long failover took; that leader then
// resigns cleanly and the last candidate takes over within a round trip.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS (comma-separated) is set.
package main

import (
	"context"
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
	err      error // Campaign's result
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

	// Each candidate's Campaign runs in a goroutine that reports on won.
	won := make(chan *candidate, 3)
	var leader *candidate
	for _, id := range []string{"alpha", "beta", "gamma"} {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
		if err != nil {
			return err
		}
		defer s.Close()
		c := &candidate{id: id, session: s, election: etcdsync.NewElection(s, name)}
		go func() {
			c.err = c.election.Campaign(ctx, c.id+" is leading")
			won <- c
		}()
		if leader == nil { // alpha leads first, the others queue behind it
			if leader, err = winner(ctx, won); err != nil {
				return err
			}
			fmt.Printf("%s leads (term %d)\n", id, leader.election.Rev())
		}
	}

	for i := 1; i <= 3; i++ {
		if err := leader.election.Proclaim(ctx, fmt.Sprintf("%s: report %d", leader.id, i)); err != nil {
			return err
		}
	}

	fmt.Printf("%s crashes without resigning (its lease expires within %v)\n", leader.id, ttl)
	crashed := time.Now()
	leader.session.Orphan()
	next, err := winner(ctx, won)
	if err != nil {
		return err
	}
	fmt.Printf("%s took over after %v (term %d)\n", next.id, time.Since(crashed).Round(time.Millisecond), next.election.Rev())

	resigned := time.Now()
	if err := next.election.Resign(ctx); err != nil {
		return err
	}
	last, err := winner(ctx, won)
	if err != nil {
		return err
	}
	fmt.Printf("%s resigned; %s took over after %v (term %d)\n", next.id, last.id, time.Since(resigned).Round(time.Millisecond), last.election.Rev())
	if err := last.election.Resign(ctx); err != nil {
		return err
	}
	resp, err := cli.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return err
	}
	if resp.Count != 0 {
		return fmt.Errorf("%d candidate keys left behind", resp.Count)
	}
	fmt.Println("all resigned; no candidate key left")
	return nil
}

// winner waits for the next candidate whose Campaign returned.
func winner(ctx context.Context, won <-chan *candidate) (*candidate, error) {
	select {
	case c := <-won:
		return c, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
