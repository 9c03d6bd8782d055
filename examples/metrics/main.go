// Command metrics is a small service that takes turns on a lock in a loop
// and serves its Prometheus metrics: two workers, each with its own
// Session reporting to one registry (etcdsync.WithMetrics) and to a logger
// (etcdsync.WithLogger, losses at Warn), run a job under the lock again and
// again. http://ADDR/metrics serves the registry while it runs; at the end
// it scrapes itself once over HTTP and prints the etcdsync lines.
//
// It starts an embedded etcd unless ETCD_ENDPOINTS or ETCDCTL_ENDPOINTS (comma-separated) is set.
//
//	go run ./examples/metrics -addr 127.0.0.1:9464 -duration 1m
//	curl -s 127.0.0.1:9464/metrics | grep etcdsync_
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const lockName = "etcdsync-example/metrics-job"

func main() {
	addr := flag.String("addr", "127.0.0.1:9464", "address to serve /metrics on")
	duration := flag.Duration("duration", 3*time.Second, "how long to run (0: until interrupted)")
	flag.Parse()
	if err := run(*addr, *duration); err != nil {
		log.Fatal(err)
	}
}

func run(addr string, duration time.Duration) (err error) {
	cli, closeAll, err := etcdsynctest.Connect()
	if err != nil {
		return err
	}
	defer closeAll()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, duration)
		defer cancel()
	}

	reg := prometheus.NewRegistry()
	metrics, err := etcdsync.NewMetrics(reg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() { // the server ends with run, whatever run returns
		shutdown, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		err = errors.Join(err, srv.Shutdown(shutdown))
		if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
	}()
	fmt.Printf("serving http://%s/metrics\n", ln.Addr())
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))

	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for w := 1; w <= 2; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- worker(ctx, w, cli, metrics, logger)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return err
		}
	}
	return printScrape("http://" + ln.Addr().String() + "/metrics")
}

// worker runs a job under the lock until ctx ends.
func worker(ctx context.Context, id int, cli *clientv3.Client, metrics *etcdsync.Metrics, logger *slog.Logger) (err error) {
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second), etcdsync.WithMetrics(metrics), etcdsync.WithLogger(logger))
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, s.Close()) }()
	m := etcdsync.NewMutex(s, lockName)
	for ctx.Err() == nil {
		err := m.Run(ctx, func(ctx context.Context) error {
			fmt.Printf("worker %d runs the job (fencing token %d)\n", id, m.Rev())
			return sleep(ctx, 200*time.Millisecond) // the job
		})
		if err != nil && ctx.Err() == nil {
			return fmt.Errorf("worker %d: %w", id, err)
		}
	}
	return nil
}

// printScrape fetches url and prints its etcdsync_ samples.
func printScrape(url string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "etcdsync_") && !strings.Contains(line, "_bucket{") {
			fmt.Println(line)
		}
	}
	return sc.Err()
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
