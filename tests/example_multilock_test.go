package tests

import (
	"context"
	"fmt"
	"log"
	"sync"
	"time"

	"github.com/etcdsync/etcdsync"
)

// Two transfers name the same two accounts in opposite orders. Each holds
// both accounts or waits; neither waits for the other in a circle.
func ExampleMultiLock() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var mu sync.Mutex
	balance := map[string]int64{"alice": 100, "bob": 100}
	transfer := func(from, to string, amount int64) {
		s, err := etcdsync.NewSession(cli)
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close()
		ml := etcdsync.NewMultiLock(s, "/accounts/"+from, "/accounts/"+to)
		err = ml.Run(ctx, func(ctx context.Context) error {
			// Both keys were written at one revision: one fencing token.
			if ml.Rev("/accounts/"+from) != ml.Rev("/accounts/"+to) {
				return fmt.Errorf("two tokens")
			}
			mu.Lock()
			defer mu.Unlock()
			balance[from] -= amount
			balance[to] += amount
			return nil
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for range 5 {
		wg.Go(func() { transfer("alice", "bob", 10) })
		wg.Go(func() { transfer("bob", "alice", 3) })
	}
	wg.Wait()
	fmt.Println("alice:", balance["alice"], "bob:", balance["bob"])
	// Output:
	// alice: 65 bob: 135
}
