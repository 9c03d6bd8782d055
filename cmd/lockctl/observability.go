//go:build unix

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// logLevels are --log-level's values; "off" logs nothing.
var logLevels = map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "error": slog.LevelError}

// checkObservability reports a bad --log-level as a usage error.
func (f *holdFlags) checkObservability() error {
	if _, ok := logLevels[f.logLevel]; !ok && f.logLevel != "off" {
		return usage(fmt.Errorf("--log-level %q: want off, debug, info, warn or error", f.logLevel))
	}
	return nil
}

// health is what /healthz answers: the state lockctl is in, and the check
// of the session (waiting) or of the hold (holding).
type health struct {
	mu    sync.Mutex
	state string
	check func() error
}

func (hl *health) set(state string, check func() error) {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	hl.state, hl.check = state, check
}

// ServeHTTP answers 200 and the state while the check passes (the session
// lives and, once holding, the hold is current), else 503 and why.
func (hl *health) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	hl.mu.Lock()
	state, check := hl.state, hl.check
	hl.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if check == nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, "starting")
		return
	}
	if err := check(); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "%s: %v\n", state, err)
		return
	}
	fmt.Fprintf(w, "ok: %s\n", state)
}

// sessionOptions returns the session's options for --log-level (records on
// stderr) and --metrics-addr (metrics, and hl's answer on /healthz, served
// until stop is called), and the func that stops the server (bounded by a
// second) and returns what it failed at; it does not block. A metrics
// address that cannot be listened on is an error (exit 1).
func (f *holdFlags) sessionOptions(hl *health) (opts []etcdsync.SessionOption, stop func() error, err error) {
	stop = func() error { return nil }
	if level, ok := logLevels[f.logLevel]; ok {
		opts = append(opts, etcdsync.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))))
	}
	if f.metricsAddr == "" {
		return opts, stop, nil
	}
	reg := prometheus.NewRegistry()
	m, err := etcdsync.NewMetrics(reg)
	if err != nil {
		return nil, stop, fail(exitFailure, err)
	}
	ln, err := net.Listen("tcp", f.metricsAddr)
	if err != nil {
		return nil, stop, fail(exitFailure, fmt.Errorf("--metrics-addr: %w", err))
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/healthz", hl)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	stop = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		err := srv.Shutdown(ctx)
		if err != nil {
			err = errors.Join(err, srv.Close())
		}
		if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
		if err != nil {
			return fmt.Errorf("metrics server: %w", err)
		}
		return nil
	}
	return append(opts, etcdsync.WithMetrics(m)), stop, nil
}

// logLevelHelp lists --log-level's values.
const logLevelHelp = "log the session's state changes on stderr at this level and above: off, debug, info, warn or error"
