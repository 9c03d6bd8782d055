package etcdsync_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// exampleEtcd starts an embedded etcd for an example.
func exampleEtcd() (*clientv3.Client, func()) {
	dir, remove := etcdtest.MustDir()
	c, err := etcdtest.StartCluster(dir, etcdtest.Options{})
	if err != nil {
		log.Fatal(err)
	}
	cli, err := clientv3.New(etcdtest.ClientConfig(c.Endpoints()))
	if err != nil {
		log.Fatal(err)
	}
	return cli, func() { cli.Close(); c.Close(); remove() }
}

func ExampleMutex() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	m := etcdsync.NewMutex(s, "/jobs/nightly-report")
	if err := m.Lock(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("locked; fencing token > 0:", m.Rev() > 0)

	// Writes guarded by the hold run only while it is current.
	if _, err := m.Do(ctx, clientv3.OpPut("/jobs/nightly-report/last-run", "today")); err != nil {
		log.Fatal(err)
	}
	if err := m.Unlock(ctx); err != nil {
		log.Fatal(err)
	}
	_, err = m.Do(ctx, clientv3.OpPut("/jobs/nightly-report/last-run", "again"))
	fmt.Println("after Unlock:", err)
	// Output:
	// locked; fencing token > 0: true
	// after Unlock: etcdsync: not held: /jobs/nightly-report is not held by this value
}

func ExampleMutex_TryLock() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	a, _ := etcdsync.NewSession(cli)
	defer a.Close()
	b, _ := etcdsync.NewSession(cli)
	defer b.Close()
	if err := etcdsync.NewMutex(a, "cron/backup").Lock(ctx); err != nil {
		log.Fatal(err)
	}
	err := etcdsync.NewMutex(b, "cron/backup").TryLock(ctx)
	fmt.Println(err)
	// Output:
	// etcdsync: locked by another holder: cron/backup/
}
