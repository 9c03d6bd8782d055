package tests

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// BenchmarkMultiLock: the cost of holding k names at once, a MultiLock
// beside k Mutexes of one session taken one after the other (in name
// order, as deadlock-free code must).
//   - uncontended: Lock then Unlock; lock-rpcs/op and unlock-rpcs/op are
//     unary RPCs, writes/op the store's revisions.
//   - contended: two holders of the same k names alternate; handoff-p50-ms
//     is the time from one's Unlock start to the other's Lock return.
func BenchmarkMultiLock(b *testing.B) {
	for _, k := range []int{1, 2, 4, 8} {
		names := make([]string, k)
		for i := range names {
			names[i] = fmt.Sprintf("bench-multi/%d", i)
		}
		for _, kind := range []string{"multilock", "mutexes"} {
			b.Run(fmt.Sprintf("uncontended/k=%d/%s", k, kind), func(b *testing.B) {
				cli, cnt, admin := benchEtcd(b)
				ctx := context.Background()
				l := newKLock(benchSession(b, cli), kind, names)
				var lockRPC, unlockRPC int64
				start := rev(b, admin)
				cnt.take()
				b.ResetTimer()
				for range b.N {
					must(b, l.Lock(ctx))
					n, _ := cnt.take()
					lockRPC += n
					must(b, l.Unlock(ctx))
					n, _ = cnt.take()
					unlockRPC += n
				}
				b.StopTimer()
				b.ReportMetric(float64(lockRPC)/float64(b.N), "lock-rpcs/op")
				b.ReportMetric(float64(unlockRPC)/float64(b.N), "unlock-rpcs/op")
				b.ReportMetric(float64(rev(b, admin)-start)/float64(b.N), "writes/op")
			})
			b.Run(fmt.Sprintf("contended/k=%d/%s", k, kind), func(b *testing.B) {
				c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
				cnt := counter{created: make(chan struct{}, 1024)}
				cli := c.Client(b, cnt.dial()...)
				ctx := context.Background()
				ls := []kLock{newKLock(benchSession(b, cli), kind, names), newKLock(benchSession(b, cli), kind, names)}
				must(b, ls[0].Lock(ctx))
				samples := make([]time.Duration, 0, b.N)
				b.ResetTimer()
				for i := range b.N {
					holder, next := ls[i%2], ls[(i+1)%2]
					got := make(chan time.Time, 1)
					var wg sync.WaitGroup
					wg.Go(func() {
						must(b, next.Lock(ctx))
						got <- time.Now()
					})
					// in its watches of its own key and the holder's on the first name
					for range 2 {
						<-cnt.created
					}
					began := time.Now()
					must(b, holder.Unlock(ctx))
					wg.Wait()
					samples = append(samples, (<-got).Sub(began))
					for len(cnt.created) > 0 { // the watches of its later names
						<-cnt.created
					}
				}
				b.StopTimer()
				must(b, ls[b.N%2].Unlock(ctx))
				reportLatency(b, samples, "handoff")
			})
		}
	}
}

// kLock holds k names: a MultiLock, or Mutexes taken in order.
type kLock interface {
	Lock(context.Context) error
	Unlock(context.Context) error
}

type mutexes []*etcdsync.Mutex

func (ms mutexes) Lock(ctx context.Context) error {
	for i, m := range ms {
		if err := m.Lock(ctx); err != nil {
			for _, held := range ms[:i] {
				held.Unlock(ctx)
			}
			return err
		}
	}
	return nil
}

func (ms mutexes) Unlock(ctx context.Context) error {
	for _, m := range ms {
		if err := m.Unlock(ctx); err != nil {
			return err
		}
	}
	return nil
}

func newKLock(s *etcdsync.Session, kind string, names []string) kLock {
	if kind == "multilock" {
		return etcdsync.NewMultiLock(s, names...)
	}
	ms := make(mutexes, len(names))
	for i, name := range names {
		ms[i] = etcdsync.NewMutex(s, name)
	}
	return ms
}
