package tests

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/etcdsync/etcdsync"
)

// A pool of workers: each joins with its address; a dispatcher watches who
// is in. A worker whose session ends (here closed; a crashed one when its
// lease expires) leaves by itself.
func ExampleGroup() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var workers []*etcdsync.Session
	for _, addr := range []string{"10.0.0.1:8080", "10.0.0.2:8080"} {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close()
		if err := etcdsync.NewGroup(s, "/pools/render").Join(ctx, addr); err != nil {
			log.Fatal(err)
		}
		workers = append(workers, s)
	}

	// The dispatcher needs no Session to read or watch the pool.
	members, _, err := etcdsync.GroupMembers(ctx, cli, "/pools/render")
	if err != nil {
		log.Fatal(err)
	}
	for _, m := range members {
		fmt.Println("in the pool:", string(m.Value))
	}
	views, err := etcdsync.WatchGroup(ctx, cli, "/pools/render")
	if err != nil {
		log.Fatal(err)
	}
	workers[0].Close()
	for v := range views { // each view is the whole pool at v.Rev
		if len(v.Members) == 1 {
			fmt.Println("left in the pool:", string(v.Members[0].Value))
			break
		}
	}
	// Output:
	// in the pool: 10.0.0.1:8080
	// in the pool: 10.0.0.2:8080
	// left in the pool: 10.0.0.2:8080
}
