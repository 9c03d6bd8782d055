package tests

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
)

// scrape reads the metrics a server exposes over HTTP.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	req, err := http.NewRequestWithContext(ctxT(t), http.MethodGet, url, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	return fams
}

// sample returns the value of the family's sample whose labels include
// labels (a counter's value, a histogram's count, a gauge's value), summed
// over the samples that match; and whether any matched.
func sample(fams map[string]*dto.MetricFamily, name string, labels ...string) (float64, bool) {
	fam, ok := fams[name]
	if !ok {
		return 0, false
	}
	var sum float64
	found := false
	for _, m := range fam.Metric {
		match := true
		for i := 0; i+1 < len(labels); i += 2 {
			if !slices.ContainsFunc(m.Label, func(l *dto.LabelPair) bool { return l.GetName() == labels[i] && l.GetValue() == labels[i+1] }) {
				match = false
			}
		}
		if !match {
			continue
		}
		found = true
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Histogram != nil:
			sum += float64(m.Histogram.GetSampleCount())
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		}
	}
	return sum, found
}

// TestMetricsScraped runs a scripted scenario on sessions that report to one
// registry, and reads the counts through promhttp over HTTP: two uncontended
// holds, a contended handoff, a TryLock on a held name, a hold whose lease an
// admin revokes, and an RWMutex write hold cut off from etcd past the TTL.
func TestMetricsScraped(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	reg := prometheus.NewRegistry()
	m, err := etcdsync.NewMetrics(reg)
	require.NoError(t, err)
	again, err := etcdsync.NewMetrics(reg) // a second registration shares the collectors
	require.NoError(t, err)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)
	ctx := ctxT(t)
	ttl := etcdsync.WithTTL(2 * time.Second)

	// Before any session: no margin.
	fams := scrape(t, srv.URL)
	_, ok := sample(fams, "etcdsync_session_deadline_margin_seconds")
	require.False(t, ok, "a margin with no live session")

	s1 := session(t, admin, etcdsync.WithMetrics(m), ttl)
	s2 := session(t, admin, etcdsync.WithMetrics(again), ttl)
	a := etcdsync.NewMutex(s1, "metrics/a")
	require.NoError(t, a.Lock(ctx))
	require.NoError(t, a.Unlock(ctx))

	// A handoff: s2 waits for s1's hold.
	b1, b2 := etcdsync.NewMutex(s1, "metrics/b"), etcdsync.NewMutex(s2, "metrics/b")
	require.NoError(t, b1.Lock(ctx))
	require.ErrorIs(t, b2.TryLock(ctx), etcdsync.ErrLocked)
	got := async(func() error { return b2.Lock(ctx) })
	waitKeys(t, admin, "metrics/b/", 2)
	require.NoError(t, b1.Unlock(ctx))
	require.NoError(t, <-got)
	require.NoError(t, b2.Unlock(ctx))

	// A lease revoked by an admin under a hold.
	s3 := session(t, admin, etcdsync.WithMetrics(m), ttl)
	r := etcdsync.NewMutex(s3, "metrics/r")
	require.NoError(t, r.Lock(ctx))
	_, err = admin.Revoke(ctx, s3.Lease())
	require.NoError(t, err)
	within(t, r.Done(), testTimeout, "revoked hold's Done")
	within(t, s3.Done(), testTimeout, "revoked session's end")
	s3.Close() // its end is reported once Close returns

	// A hold cut off from etcd until the session's local deadline.
	cut, p := faults.Proxied(t, c)
	s4 := session(t, cut, etcdsync.WithMetrics(m), ttl)
	rw := etcdsync.NewRWMutex(s4, "metrics/rw")
	require.NoError(t, rw.Lock(ctx))
	p.Blackhole(true)
	within(t, s4.Done(), testTimeout, "cut session's end")
	require.ErrorIs(t, s4.Err(), etcdsync.ErrLostContact)
	p.Blackhole(false)
	s4.Close() // its end, and its hold's, are reported once Close returns

	fams = scrape(t, srv.URL)
	expect := func(want float64, name string, labels ...string) {
		t.Helper()
		v, _ := sample(fams, name, labels...)
		require.Equal(t, want, v, "%s %v", name, labels)
	}
	expect(4, "etcdsync_acquire_wait_seconds", "kind", "mutex") // a, b1, b2, r
	expect(1, "etcdsync_acquire_wait_seconds", "kind", "rwmutex")
	expect(4, "etcdsync_hold_seconds", "kind", "mutex")
	expect(1, "etcdsync_hold_seconds", "kind", "rwmutex")
	expect(1, "etcdsync_acquire_errors_total", "kind", "mutex", "reason", "locked")
	expect(1, "etcdsync_acquire_errors_total") // and nothing else failed
	// The revoked hold ends by its watch (key deleted) or with its session
	// (lease gone), whichever notices first; the cut one with its session.
	deleted, _ := sample(fams, "etcdsync_holds_lost_total", "kind", "mutex", "cause", "key_deleted")
	gone, _ := sample(fams, "etcdsync_holds_lost_total", "kind", "mutex", "cause", "lease_gone")
	require.Equal(t, 1.0, deleted+gone, "revoked hold lost once")
	expect(1, "etcdsync_holds_lost_total", "kind", "rwmutex", "cause", "lost_contact")
	expect(2, "etcdsync_holds_lost_total")
	expect(1, "etcdsync_sessions_expired_total", "cause", "lease_gone")
	expect(1, "etcdsync_sessions_expired_total", "cause", "lost_contact")
	expect(2, "etcdsync_sessions_expired_total")
	rtts, _ := sample(fams, "etcdsync_keepalive_rtt_seconds")
	require.GreaterOrEqual(t, rtts, 1.0, "keepalives acknowledged")
	lates, ok := sample(fams, "etcdsync_session_lateness_seconds")
	require.True(t, ok && lates >= 1, "the keepalive loops' lateness observed (%v)", lates)
	margin, ok := sample(fams, "etcdsync_session_deadline_margin_seconds")
	require.True(t, ok, "a margin while s1 and s2 live")
	require.Greater(t, margin, 0.0)
	require.LessOrEqual(t, margin, 2.0)

	// A session that Close ends is not an expiry; its margin goes.
	require.NoError(t, s1.Close())
	require.NoError(t, s2.Close())
	fams = scrape(t, srv.URL)
	expect(2, "etcdsync_sessions_expired_total")
	_, ok = sample(fams, "etcdsync_session_deadline_margin_seconds")
	require.False(t, ok, "a margin after every session ended")
}

// TestMetricsBadRegistry: a nil registry, or one with another collector under
// one of the names, is an error wrapping ErrInvalidArgument, not a panic.
func TestMetricsBadRegistry(t *testing.T) {
	t.Parallel()
	_, err := etcdsync.NewMetrics(nil)
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "etcdsync_holds_lost_total", Help: "not ours"}))
	_, err = etcdsync.NewMetrics(reg)
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
}

// records is a slog.Handler that keeps every record.
type records struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec.Clone())
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

// find returns the attributes of the records with message msg, and their levels.
func (r *records) find(msg string) ([]map[string]slog.Value, []slog.Level) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var attrs []map[string]slog.Value
	var levels []slog.Level
	for _, rec := range r.recs {
		if rec.Message != msg {
			continue
		}
		a := map[string]slog.Value{}
		rec.Attrs(func(at slog.Attr) bool { a[at.Key] = at.Value; return true })
		attrs = append(attrs, a)
		levels = append(levels, rec.Level)
	}
	return attrs, levels
}

// TestLoggerRecords: one record per state change, with its attributes: a
// session's start, a hold acquired and released, a hold lost to a revoked
// lease (Warn) and the session's end (Warn: it ended on its own).
func TestLoggerRecords(t *testing.T) {
	t.Parallel()
	cli := single(t).Client(t)
	rec := &records{}
	ctx := ctxT(t)
	s := session(t, cli, etcdsync.WithLogger(slog.New(rec)), etcdsync.WithTTL(2*time.Second))
	lease := s.Lease()
	m := etcdsync.NewMutex(s, "log/a")
	require.NoError(t, m.Lock(ctx))
	key, rev := m.Key(), m.Rev()
	require.NoError(t, m.Unlock(ctx))
	require.NoError(t, m.Lock(ctx))
	lostRev := m.Rev()
	_, err := cli.Revoke(ctx, lease)
	require.NoError(t, err)
	within(t, m.Done(), testTimeout, "revoked hold's Done")
	within(t, s.Done(), testTimeout, "revoked session's end")
	s.Close() // the end is reported before Close returns

	hexLease := func(v slog.Value) bool { return "/"+v.String() == keyOf("", s) }
	started, _ := rec.find("etcdsync: session started")
	require.Len(t, started, 1)
	require.True(t, hexLease(started[0]["lease"]))

	acquired, levels := rec.find("etcdsync: hold acquired")
	require.Len(t, acquired, 2)
	require.Equal(t, slog.LevelDebug, levels[0])
	require.Equal(t, "log/a", acquired[0]["name"].String())
	require.Equal(t, key, acquired[0]["key"].String())
	require.Equal(t, rev, acquired[0]["rev"].Int64())
	require.Equal(t, "mutex", acquired[0]["kind"].String())
	require.True(t, hexLease(acquired[0]["lease"]))
	require.Equal(t, slog.KindDuration, acquired[0]["wait"].Kind())

	released, levels := rec.find("etcdsync: hold released")
	require.Len(t, released, 1)
	require.Equal(t, slog.LevelDebug, levels[0])
	require.Equal(t, rev, released[0]["rev"].Int64())
	require.Equal(t, slog.KindDuration, released[0]["held"].Kind())

	lost, levels := rec.find("etcdsync: hold lost")
	require.Len(t, lost, 1)
	require.Equal(t, slog.LevelWarn, levels[0])
	require.Equal(t, lostRev, lost[0]["rev"].Int64())
	cause, ok := lost[0]["cause"].Any().(error)
	require.True(t, ok)
	require.True(t, errors.Is(cause, etcdsync.ErrNotHeld) || errors.Is(cause, etcdsync.ErrSessionExpired), "cause %v", cause)

	ended, levels := rec.find("etcdsync: session ended")
	require.Len(t, ended, 1)
	require.Equal(t, slog.LevelWarn, levels[0])
	cause, ok = ended[0]["cause"].Any().(error)
	require.True(t, ok)
	require.ErrorIs(t, cause, etcdsync.ErrSessionExpired)
}
